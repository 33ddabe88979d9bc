"""TLS and mutual TLS on the gRPC server, with certificates made in the test: handshakes succeed
with the right certificates and fail without them."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvquota.client import NO_RETRIES, AsyncKvquotaClient, ServerUnavailable, Tls
from kvquota.v1 import admin_pb2
from quota_service.api import server
from quota_service.cli import main as cli_main
from quota_service.config import Settings, SettingsError

Key = ec.EllipticCurvePrivateKey


def certificate(
    name: str, key: Key, issuer: tuple[x509.Certificate, Key] | None, *, ca: bool = False
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256())


def pem(value: x509.Certificate | Key) -> bytes:
    if isinstance(value, x509.Certificate):
        return value.public_bytes(serialization.Encoding.PEM)
    return value.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, bytes]:
    """A CA, a server certificate for 127.0.0.1, a client certificate, and a stranger's."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("kvquota test CA", ca_key, None, ca=True)
    made: dict[str, bytes] = {"ca": pem(ca)}
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        made[name] = pem(certificate(name, key, (ca, ca_key)))
        made[f"{name}-key"] = pem(key)
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    made["stranger"] = pem(certificate("stranger", stranger_key, None))
    made["stranger-key"] = pem(stranger_key)
    for name, data in made.items():
        (tmp_path / f"{name}.pem").write_bytes(data)
    return made


async def healthy(address: str, credentials: grpc.ChannelCredentials | None) -> bool:
    channel = (
        grpc.aio.secure_channel(address, credentials)
        if credentials is not None
        else grpc.aio.insecure_channel(address)
    )
    async with channel:
        try:
            # The health stub is typed for sync channels only.
            stub: Any = health_pb2_grpc.HealthStub(channel)
            answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


async def test_tls_and_mutual_tls(
    settings: Settings, database_url: str, pki: dict[str, bytes], tmp_path: Path
) -> None:
    files = {name: str(tmp_path / f"{name}.pem") for name in pki}
    tls = replace(settings, tls_cert_file=files["server"], tls_key_file=files["server-key"])
    running = await server.start(tls, database_url)
    address = f"127.0.0.1:{running.port}"
    try:
        assert await healthy(address, grpc.ssl_channel_credentials(pki["ca"]))
        assert not await healthy(address, None)  # plaintext is refused
        assert not await healthy(address, grpc.ssl_channel_credentials(pki["stranger"]))
        listing = ["instances", "--server", address, "--json"]
        assert await asyncio.to_thread(cli_main, [*listing, "--tls-ca", files["ca"]]) == 0
        assert await asyncio.to_thread(cli_main, listing) == 1  # the CLI dialled plaintext
    finally:
        await running.stop(0)

    mutual = replace(tls, tls_client_ca_file=files["ca"])
    running = await server.start(mutual, database_url)
    address = f"127.0.0.1:{running.port}"
    try:
        client = grpc.ssl_channel_credentials(pki["ca"], pki["client-key"], pki["client"])
        assert await healthy(address, client)
        assert not await healthy(address, grpc.ssl_channel_credentials(pki["ca"]))  # no cert
        stranger = grpc.ssl_channel_credentials(pki["ca"], pki["stranger-key"], pki["stranger"])
        assert not await healthy(address, stranger)  # a certificate the CA did not sign
        identified = ["--tls-ca", files["ca"], "--tls-cert", files["client"]]
        listing = ["tenants", "--server", address, *identified, "--tls-key", files["client-key"]]
        assert await asyncio.to_thread(cli_main, listing) == 0
        own = Tls.from_files(files["ca"], files["client"], files["client-key"])
        async with AsyncKvquotaClient(address, tls=own, retry=NO_RETRIES) as kvquota:
            await kvquota.admin.ListTenants(admin_pb2.ListTenantsRequest())
        async with AsyncKvquotaClient(address, tls=Tls(pki["ca"]), retry=NO_RETRIES) as kvquota:
            with pytest.raises(ServerUnavailable):  # no client certificate: no handshake
                await kvquota.admin.ListTenants(admin_pb2.ListTenantsRequest())
    finally:
        await running.stop(0)


def test_tls_settings_are_checked_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="go together"):
        Settings(tls_cert_file=str(tmp_path / "x.pem"))
    with pytest.raises(SettingsError, match="no such file"):
        Settings(tls_cert_file=str(tmp_path / "x.pem"), tls_key_file=str(tmp_path / "y.pem"))
    with pytest.raises(SettingsError, match="mutual TLS"):
        Settings(tls_client_ca_file=str(tmp_path / "ca.pem"))

"""Cache salts and API keys never show in logs, errors, metrics or the audit log.

A `kvquota serve` process logs at DEBUG while a whole scenario runs through it: keys made and
revoked, admissions with prefix hashing, a pin, a salt rotation, refusals of every kind, a reclaim
plan, usage and an offboarding. Then everything it wrote and served is searched for every salt
the tenants ever had and every key."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO

import grpc
import httpx
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    admission_pb2,
    admission_pb2_grpc,
    billing_pb2,
    billing_pb2_grpc,
)
from kvquota.v1 import resources_pb2 as pb
from quota_service import demo
from quota_service.core import access
from quota_service.engine.simulated import SimulatedHost
from quota_service.store.access import create_bootstrap_key
from tests import processes

ADDRESS = re.compile(r"serving gRPC on (\S+)")
METRICS = re.compile(r"serving metrics on (\S+)")
INSTANCE = f"instances/{demo.SIMULATED_INSTANCE}"
PROMPT = list(range(1000, 1000 + 64))


@pytest.fixture
async def host(database_url: str) -> AsyncIterator[SimulatedHost]:
    simulated, endpoints = await demo.start_simulated_host()
    await demo.seed(database_url, endpoints)
    yield simulated
    await simulated.close()


async def salts(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT cache_salt FROM tenants UNION SELECT cache_salt FROM namespaces")
        )
        return set(rows.scalars())


def serve_at_debug(database_url: str, stderr: IO[str]) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "KVQUOTA_DATABASE_URL": database_url,
        "KVQUOTA_GRPC_LISTEN": "127.0.0.1:0",
        "KVQUOTA_METRICS_LISTEN": "127.0.0.1:0",
        "KVQUOTA_METRICS_REFRESH_SECONDS": "0.1",
        "KVQUOTA_LOG_LEVEL": "DEBUG",
        "KVQUOTA_LOG_FORMAT": "json",
        "KVQUOTA_AUTH_REQUIRED": "true",
        "KVQUOTA_AUTH_CACHE_SECONDS": "0.05",
        "KVQUOTA_REAPER_INTERVAL_SECONDS": "0.2",
    }
    return processes.popen(
        [sys.executable, "-m", "quota_service.cli", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def test_no_salt_or_key_in_logs_errors_metrics_or_audit(
    engine: AsyncEngine, database_url: str, host: SimulatedHost, tmp_path: Path
) -> None:
    _, root = await create_bootstrap_key(database_url, "root")
    secrets = {root}
    seen_salts = await salts(engine)
    stderr = (tmp_path / "stderr").open("w+")
    process = serve_at_debug(database_url, stderr)
    assert process.stdout is not None
    said: list[str] = []  # every answer's text: replies and error details
    try:
        lines = iter(process.stdout)
        address = next(m.group(1) for line in lines if (m := ADDRESS.search(line)))
        metrics_url = next(m.group(1) for line in lines if (m := METRICS.search(line)))
        async with grpc.aio.insecure_channel(address) as channel:
            admin = admin_pb2_grpc.AdminServiceStub(channel)
            gateway = admission_pb2_grpc.AdmissionServiceStub(channel)
            billing = billing_pb2_grpc.BillingServiceStub(channel)

            async def refused(call: object) -> None:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call  # type: ignore[misc]
                said.append(f"{error.value.details()} {error.value.trailing_metadata()}")

            as_root = bearer(root)
            made = await admin.CreateApiKey(
                admin_pb2.CreateApiKeyRequest(
                    display_name="gw", role=pb.ROLE_GATEWAY, tenants=["tenants/acme"]
                ),
                metadata=as_root,
            )
            gw = made.secret
            secrets.add(gw)
            said.append(str(made.api_key))

            def admit(request_id: str, tenant: str = "acme") -> admission_pb2.AdmitRequest:
                return admission_pb2.AdmitRequest(
                    tenant=f"tenants/{tenant}",
                    request_id=request_id,
                    instance=INSTANCE,
                    prompt_tokens=len(PROMPT),
                    max_output_tokens=16,
                    prompt_token_ids=PROMPT,
                )

            first = await gateway.Admit(admit("r1"), metadata=bearer(gw))
            assert first.cache_salt in seen_salts
            pin = admin_pb2.PinPrefixRequest(
                parent="tenants/acme", pin_id="system", instance=INSTANCE, token_ids=PROMPT[:32]
            )
            said.append(str(await admin.PinPrefix(pin, metadata=as_root)))
            await admin.RotateCacheSalt(
                admin_pb2.RotateCacheSaltRequest(name="tenants/acme"), metadata=as_root
            )
            seen_salts |= await salts(engine)
            second = await gateway.Admit(admit("r2"), metadata=bearer(gw))
            assert second.cache_salt != first.cache_salt
            release = admission_pb2.ReleaseRequest(
                name="tenants/acme/reservations/r1", output_tokens=3
            )
            said.append(str(await gateway.Release(release, metadata=bearer(gw))))

            # Refusals of every kind: bad keys, another tenant, bad input, unknown things.
            key_id = made.api_key.name.removeprefix("apiKeys/")
            for token in (f"kvq_{key_id}_{'x' * 43}", gw + "x", gw[:-1], "Bearer", root[::-1]):
                await refused(gateway.Admit(admit("r3"), metadata=bearer(token)))
            await refused(gateway.Admit(admit("r4", tenant="globex"), metadata=bearer(gw)))
            await refused(
                admin.GetTenant(
                    admin_pb2.GetTenantRequest(name="tenants/globex"), metadata=bearer(gw)
                )
            )
            await refused(
                gateway.Admit(
                    admission_pb2.AdmitRequest(tenant="tenants/acme", prompt_tokens=-1),
                    metadata=bearer(gw),
                )
            )
            await refused(
                admin.RotateCacheSalt(
                    admin_pb2.RotateCacheSaltRequest(name="tenants/nobody"), metadata=as_root
                )
            )
            job = await admin.CreateReclaimJob(
                admin_pb2.CreateReclaimJobRequest(
                    instance=INSTANCE,
                    target_blocks=8,
                    max_tier=pb.RECLAIM_TIER_EVICT,
                    dry_run=True,
                    request_id="plan-1",
                ),
                metadata=as_root,
            )
            said.append(str(job))
            summary = await billing.GetUsageSummary(
                billing_pb2.GetUsageSummaryRequest(
                    start_time=Timestamp(seconds=0), end_time=Timestamp(seconds=3600 * 10**6)
                ),
                metadata=as_root,
            )
            said.append(str(summary))
            said.append(
                str(
                    await admin.DeleteTenant(
                        admin_pb2.DeleteTenantRequest(name="tenants/globex"), metadata=as_root
                    )
                )
            )
            await admin.RevokeApiKey(
                admin_pb2.RevokeApiKeyRequest(name=made.api_key.name), metadata=as_root
            )
            said.append(
                str(
                    await admin.ListApiKeys(
                        admin_pb2.ListApiKeysRequest(show_revoked=True), metadata=as_root
                    )
                )
            )
            said.append(
                str(
                    await admin.ListAuditEvents(
                        admin_pb2.ListAuditEventsRequest(), metadata=as_root
                    )
                )
            )
            for name in ("tenants/acme", INSTANCE):
                said.append(
                    str(
                        await admin.GetTenant(
                            admin_pb2.GetTenantRequest(name=name), metadata=as_root
                        )
                    )
                    if name.startswith("tenants/")
                    else str(
                        await admin.GetInstance(
                            admin_pb2.GetInstanceRequest(name=name), metadata=as_root
                        )
                    )
                )
        async with httpx.AsyncClient() as client:
            scraped = (await client.get(metrics_url, timeout=5)).text
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    stdout = process.stdout.read()
    process.stdout.close()
    stderr.seek(0)
    logged = stderr.read()
    stderr.close()

    # The logs are real: JSON lines, with the request ids of the calls they were written in.
    records = [json.loads(line) for line in logged.splitlines() if line.startswith("{")]
    assert len(records) > 10
    assert any("request_id" in r for r in records)
    assert "kvquota_instance_blocks" in scraped
    haystacks = {"logs": logged + stdout, "metrics": scraped, "answers": "\n".join(said)}
    # Each key whole, and its secret part alone (which may itself contain "_").
    parsed = [access.parse_token(t) for t in secrets]
    needles = seen_salts | secrets | {p[1] for p in parsed if p is not None}
    assert len(needles) == len(seen_salts) + 2 * len(secrets)
    assert len(seen_salts) >= 3  # acme's old and new salts, globex's
    for where, haystack in haystacks.items():
        for needle in needles:
            assert needle not in haystack, f"a secret is in the {where}"

"""kvquota's gateway adapters tested as they run (`make test-gateways`): real vLLM on the CPU
serving a tiny random model with its tokenizer, a kvquota server on a real PostgreSQL, Envoy with
kvquota's external processor (examples/envoy/envoy.yaml, its ports and keys changed), and the
LiteLLM proxy with kvquota's plugin, each its own process. The gateways run from the venv
`make test-gateways` builds (.venv-gateways); without it the tests fail, they never skip.

They share one engine, one kvquota and one of each gateway for the session; each test uses its
own prompts (vLLM's prefix cache outlives a test) and its own request ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvquota.client import AsyncKvquotaClient, KvquotaClient
from kvquota.v1 import admin_pb2
from kvquota.v1 import resources_pb2 as pb
from tests.databases import Databases
from tests.engines.conftest import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_GPU_BLOCKS,
    ROOT,
    Engine,
    engine_at,
    free_ports,
    start_vllm,
    stop_vllm,
)
from tests.integration.grpc_helpers import GIB, free_port

GATEWAYS_BIN = Path(os.environ.get("KVQUOTA_GATEWAYS_BIN", ROOT / ".venv-gateways" / "bin"))
ENGINES_PYTHON = Path(
    os.environ.get("KVQUOTA_ENGINES_PYTHON", ROOT / ".venv-engines" / "bin" / "python")
)
STARTUP_SECONDS = 120
INSTANCE = "chat-0"
# Short, so a gateway killed mid-stream leaves a lease that ends within the test.
LEASE_TTL_SECONDS = 3
# Tenants, with the keys envoy.yaml and the LiteLLM auth give their callers. "tight" may have
# 600 tokens in flight.
KEYS = {"acme": "acme-key", "globex": "globex-key", "tight": "tight-key"}
TIGHT_TOKENS = 600


@dataclass(frozen=True)
class Stack:
    engine: Engine
    kvquota: str
    envoy_url: str
    litellm_url: str
    ext_proc: subprocess.Popen[bytes]
    logs: Path


def _spawn(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("a") as out:
        return subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_until(
    ready: Callable[[], bool], process: subprocess.Popen[bytes], what: str, log: Path
) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while True:
        if process.poll() is not None:
            pytest.fail(f"{what} exited with {process.returncode}; see {log}")
        with contextlib.suppress(httpx.HTTPError, grpc.RpcError):
            if ready():
                return
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not start within {STARTUP_SECONDS}s; see {log}")
        time.sleep(0.3)


def grpc_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)  # typed for the asyncio stub only
        answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture(scope="session")
def gateways_bin() -> Path:
    if not (GATEWAYS_BIN / "envoy").exists():
        pytest.fail(f"{GATEWAYS_BIN} has no envoy: run `make test-gateways`, which builds it")
    if not ENGINES_PYTHON.exists():
        pytest.fail(f"{ENGINES_PYTHON} is missing: run `make test-gateways`, which builds it")
    return GATEWAYS_BIN


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-logs")


@pytest.fixture(scope="session")
def chat_model(gateways_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("tiny-chat-model")
    subprocess.run([ENGINES_PYTHON, ROOT / "scripts" / "make_tiny_model.py", model], check=True)
    return model


@pytest.fixture(scope="session")
def engine(chat_model: Path, logs: Path) -> Iterator[Engine]:
    ports = free_ports()
    process = start_vllm(ENGINES_PYTHON, chat_model, ports, logs / "vllm.log", with_tokenizer=True)
    yield engine_at(chat_model, ports, ENGINES_PYTHON)
    stop_vllm(process)


@pytest.fixture(scope="session")
def kvquota_address(databases: Databases, logs: Path) -> Iterator[str]:
    """A kvquota server on its own database, with the engine's instance and the tenants."""
    with databases.fresh() as database_url:
        address = f"127.0.0.1:{free_port()}"
        env = {
            **os.environ,
            "KVQUOTA_DATABASE_URL": database_url,
            "KVQUOTA_GRPC_LISTEN": address,
            "KVQUOTA_METRICS_LISTEN": "",
            "KVQUOTA_AUTH_REQUIRED": "false",
            "KVQUOTA_REAPER_INTERVAL_SECONDS": "0.2",
        }
        log = logs / "kvquota.log"
        server = _spawn([sys.executable, "-m", "quota_service.cli", "serve"], log, env)
        wait_until(lambda: grpc_serving(address), server, "kvquota", log)
        yield address
        stop_vllm(server)


@pytest.fixture(scope="session")
def registered(kvquota_address: str, engine: Engine) -> str:
    """The engine as instance chat-0 (kvquota follows its events and aborts in it), and the
    tenants."""
    with KvquotaClient(kvquota_address) as client:
        client.admin.RegisterInstance(
            admin_pb2.RegisterInstanceRequest(
                instance_id=INSTANCE,
                model=engine.model,
                block_size=BLOCK_SIZE,
                max_model_len=MAX_MODEL_LEN,
                num_gpu_blocks=NUM_GPU_BLOCKS - 1,  # vLLM's null block is never handed out
                engine=pb.EngineEndpoints(
                    url=engine.base_url,
                    kv_events_endpoint=engine.events,
                    kv_replay_endpoint=engine.replay,
                ),
            )
        )
        for tenant in KEYS:
            tokens = TIGHT_TOKENS if tenant == "tight" else 10**9
            quota = pb.TenantQuota(
                max_blocks=10**6,
                max_tokens_in_flight=tokens,
                max_queued_requests=10,
                max_pinned_blocks=10,
                max_cpu_tier_bytes=GIB,
            )
            client.admin.CreateTenant(
                admin_pb2.CreateTenantRequest(tenant_id=tenant, tenant=pb.Tenant(quota=quota))
            )
    return kvquota_address


def gateway_config(stack_dir: Path, kvquota: str, engine: Engine, listen: str) -> Path:
    """The gateways' TOML: the tiny model's tokenizer, tenants from Envoy's api_key_auth or the
    LiteLLM key's team; no queueing (a refusal is immediate)."""
    path = stack_dir / "kvquota-gateway.toml"
    path.write_text(
        f"""
kvquota = ["{kvquota}"]
wait_timeout_seconds = 0
lease_ttl_seconds = {LEASE_TTL_SECONDS}
default_max_tokens = 16

[models."{engine.model}"]
tokenizer = "{engine.model}"
instance = "{INSTANCE}"

[envoy]
listen = "{listen}"
tenant_header = "x-kvquota-tenant"

[litellm]
tenant_from = "team"
"""
    )
    return path


def start_ext_proc(bin_dir: Path, config: Path, listen: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = _spawn(
        [str(bin_dir / "kvquota"), "gateway", "envoy", "--config", str(config)], log, env
    )
    wait_until(lambda: grpc_serving(listen), process, "the external processor", log)
    return process


def envoy_yaml(stack_dir: Path, listen_port: int, engine: Engine, ext_proc_port: int) -> Path:
    """examples/envoy/envoy.yaml on this run's ports, with a key for tenant "tight" too."""
    text = (ROOT / "examples" / "envoy" / "envoy.yaml").read_text()
    engine_port = int(engine.base_url.rsplit(":", 1)[1])
    for example, port in (
        ("port_value: 10000", listen_port),
        ("port_value: 8000", engine_port),
        ("port_value: 50052", ext_proc_port),
        ("port_value: 9901", free_port()),
    ):
        assert example in text
        text = text.replace(example, f"port_value: {port}")
    globex = "- { key: globex-key, client: globex }"
    indent = text[: text.index(globex)].rsplit("\n", 1)[1]
    text = text.replace(globex, f"{globex}\n{indent}- {{ key: tight-key, client: tight }}")
    path = stack_dir / "envoy.yaml"
    path.write_text(text)
    return path


def start_envoy(bin_dir: Path, config: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    process = _spawn(
        [str(bin_dir / "envoy"), "-c", str(config), "--base-id", str(port)], log, dict(os.environ)
    )

    def listening() -> bool:
        httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
        return True

    wait_until(listening, process, "envoy", log)
    return process


LITELLM_AUTH = '''
"""Test keys for the LiteLLM proxy: each key's team is its kvquota tenant."""
from fastapi import Request
from litellm.proxy._types import UserAPIKeyAuth

TEAMS = {teams!r}


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    return UserAPIKeyAuth(api_key=api_key, team_id=TEAMS[api_key.removeprefix("Bearer ")])
'''


def start_litellm(
    bin_dir: Path, stack_dir: Path, gateway: Path, engine: Engine, log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """The proxy with kvquota's plugin as examples/litellm/config.yaml registers it, and a
    custom auth that gives each test key its team (LiteLLM's virtual keys need its database)."""
    (stack_dir / "team_keys.py").write_text(
        LITELLM_AUTH.format(teams={key: tenant for tenant, key in KEYS.items()})
    )
    config = {
        "model_list": [
            {
                "model_name": engine.model,
                "litellm_params": {
                    "model": f"hosted_vllm/{engine.model}",
                    "api_base": f"{engine.base_url}/v1",
                    "api_key": "none",
                },
            }
        ],
        "litellm_settings": {
            "callbacks": ["kvquota.gateways.litellm_proxy.admission"],
            "num_retries": 0,
        },
        "general_settings": {"custom_auth": "team_keys.user_api_key_auth"},
    }
    path = stack_dir / "litellm.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    env = {
        **os.environ,
        "KVQUOTA_GATEWAY_CONFIG": str(gateway),
        "LITELLM_MASTER_KEY": "sk-master-test",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "HF_HUB_OFFLINE": "1",
        "DISABLE_SCHEMA_UPDATE": "True",
    }
    process = _spawn(
        [
            str(bin_dir / "litellm"),
            "--config",
            str(path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        log,
        env,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        return httpx.get(f"{url}/health/liveliness", timeout=2).status_code == 200

    wait_until(healthy, process, "the LiteLLM proxy", log)
    return process, url


@pytest.fixture(scope="session")
def stack(
    gateways_bin: Path,
    engine: Engine,
    registered: str,
    logs: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    stack_dir = tmp_path_factory.mktemp("gateways")
    ext_proc_port, envoy_port = free_port(), free_port()
    listen = f"127.0.0.1:{ext_proc_port}"
    gateway = gateway_config(stack_dir, registered, engine, listen)
    ext_proc = start_ext_proc(gateways_bin, gateway, listen, logs / "ext_proc.log")
    envoy = start_envoy(
        gateways_bin,
        envoy_yaml(stack_dir, envoy_port, engine, ext_proc_port),
        envoy_port,
        logs / "envoy.log",
    )
    litellm, litellm_url = start_litellm(
        gateways_bin, stack_dir, gateway, engine, logs / "litellm.log"
    )
    yield Stack(engine, registered, f"http://127.0.0.1:{envoy_port}", litellm_url, ext_proc, logs)
    for process in (litellm, envoy, ext_proc):
        stop_vllm(process)


@pytest.fixture
async def kvquota(stack: Stack) -> AsyncIterator[AsyncKvquotaClient]:
    async with AsyncKvquotaClient(stack.kvquota) as client:
        yield client

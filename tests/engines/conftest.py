"""Contract tests against a real vLLM on the CPU (`make test-engines`): a tiny random model made
on the spot, served with KV events and a 64-block pool. The engine's Python is the one
`make test-engines` builds (.venv-engines); without it the tests fail, they never skip."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINES_PYTHON = Path(
    os.environ.get("KVQUOTA_ENGINES_PYTHON", ROOT / ".venv-engines" / "bin" / "python")
)
BLOCK_SIZE = 32
NUM_GPU_BLOCKS = 64
# All the pool can hold: long enough that a generation outlasts the abort sent to stop it.
MAX_MODEL_LEN = BLOCK_SIZE * (NUM_GPU_BLOCKS - 1)  # vLLM keeps one block as its null block
STARTUP_SECONDS = 300


@dataclass(frozen=True)
class Engine:
    model: str
    base_url: str
    events: str
    replay: str
    python: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def engine_python() -> Path:
    if not ENGINES_PYTHON.exists():
        pytest.fail(f"{ENGINES_PYTHON} is missing: run `make test-engines`, which builds it")
    return ENGINES_PYTHON


def start_vllm(
    python: Path, model: Path, ports: tuple[int, int, int], log_path: Path
) -> subprocess.Popen[bytes]:
    """Serve `model` with KV events on (http, events, replay) ports; returns once healthy."""
    http_port, events_port, replay_port = ports
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv",
    }
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    env.pop("PYTHONHASHSEED", None)  # vLLM's root hash depends on it
    log = log_path.open("a")
    process = subprocess.Popen(
        [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--block-size",
            str(BLOCK_SIZE),
            "--enforce-eager",
            "--enable-prefix-caching",
            "--num-gpu-blocks-override",
            str(NUM_GPU_BLOCKS),
            # On the CPU this is the share of host memory vLLM may take.
            "--gpu-memory-utilization",
            "0.3",
            "--skip-tokenizer-init",
            "--port",
            str(http_port),
            "--kv-events-config",
            json.dumps(kv_events),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        # Its own process group: vLLM's engine core is a child that holds the event sockets.
        start_new_session=True,
    )
    log.close()
    deadline = time.monotonic() + STARTUP_SECONDS
    while True:
        if process.poll() is not None:
            pytest.fail(f"vLLM exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"vLLM did not start within {STARTUP_SECONDS}s; see {log_path}")
        time.sleep(1)


def stop_vllm(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """Signal vLLM's whole process group (the engine core too) and wait for it to go."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for _ in range(100):  # until no process of the group is left
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


@pytest.fixture(scope="session")
def tiny_model(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("tiny-model")
    subprocess.run([engine_python, ROOT / "scripts" / "make_tiny_model.py", model], check=True)
    return model


def free_ports() -> tuple[int, int, int]:
    return _free_port(), _free_port(), _free_port()


@pytest.fixture(scope="session")
def vllm(
    engine_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    ports = free_ports()
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    process = start_vllm(engine_python, tiny_model, ports, log)
    yield engine_at(tiny_model, ports, engine_python)
    stop_vllm(process)


def engine_at(model: Path, ports: tuple[int, int, int], python: Path) -> Engine:
    http_port, events_port, replay_port = ports
    return Engine(
        str(model),
        f"http://127.0.0.1:{http_port}",
        f"tcp://127.0.0.1:{events_port}",
        f"tcp://127.0.0.1:{replay_port}",
        python,
    )

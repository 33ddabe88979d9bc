"""The processes tests start (kvquota servers, the CLI, the benchmark suite). Each starts in a
session of its own, so that it and whatever it starts in turn are one process group, and is
registered, so that none outlives its test: a test stops its processes itself (stop), and
tests/conftest.py kills what a failed or timed-out test left behind (a timeout raises wherever
the test is; an asyncio test's own finally blocks may never run) and fails a test that passed
but left a process running, or a session that ends with one."""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def running(pgid: int) -> bool:
    """Whether a process of the group runs (a zombie does not: PID 1 may take seconds to collect
    the orphans of a killed group)."""
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue  # it just exited
            state, _, group = stat.rsplit(")", 1)[1].split()[:3]
            if int(group) == pgid and state != "Z":
                return True
    return False


@dataclass(frozen=True)
class _Group:
    pgid: int
    command: str
    popen: subprocess.Popen[str] | None  # asyncio's child watcher collects the others

    def collect(self) -> None:
        """Waits for the (killed) leader, and closes its pipes: no ResourceWarning later."""
        if self.popen is not None:
            self.popen.wait()
            for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
                if pipe is not None:
                    pipe.close()

    def alive(self) -> bool:
        return running(self.pgid)

    def signal(self, signum: int) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.pgid, signum)


_started: list[_Group] = []


def popen(command: Sequence[str], **options: Any) -> subprocess.Popen[str]:
    """subprocess.Popen(command, text=True, **options) in a new session, registered."""
    process = subprocess.Popen(command, text=True, start_new_session=True, **options)
    _started.append(_Group(process.pid, " ".join(command), process))
    return process


async def exec_async(*command: str, **options: Any) -> asyncio.subprocess.Process:
    """asyncio.create_subprocess_exec(*command, **options) in a new session, registered."""
    process = await asyncio.create_subprocess_exec(*command, start_new_session=True, **options)
    _started.append(_Group(process.pid, " ".join(command), None))
    return process


def stop(process: subprocess.Popen[str], timeout: float = 30) -> int:
    """SIGTERM to its group (SIGCONT too, should it be paused), then SIGKILL to what is left of
    the group once the process exited, or `timeout` seconds passed (TimeoutExpired is raised
    then); its pipes closed. Returns its exit code; stopping it again does no harm."""
    group = next(g for g in _started if g.popen is process)
    group.signal(signal.SIGTERM)
    group.signal(signal.SIGCONT)
    try:
        process.wait(timeout)
    finally:
        group.signal(signal.SIGKILL)
        group.collect()
    return process.returncode


def started() -> int:
    """A mark: kill_since(mark) considers the processes started after it."""
    return len(_started)


def kill_since(mark: int = 0) -> list[str]:
    """SIGKILL to each group started after `mark` that still has a process, and a few seconds
    for them to go; their commands."""
    left = [g for g in _started[mark:] if g.alive()]
    for group in left:
        group.signal(signal.SIGKILL)
        group.collect()
    deadline = time.monotonic() + 5
    while any(g.alive() for g in left) and time.monotonic() < deadline:
        time.sleep(0.01)
    return [group.command for group in left]


# The last resort, should pytest end without its teardown (an interrupt).
atexit.register(kill_since)

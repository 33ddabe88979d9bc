"""Where a server process spends its CPU under load: a py-spy profile of it (when py-spy is
installed), summed by function and by layer of the code.
"""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def py_spy() -> str | None:
    """The py-spy binary, when installed (next to this Python, or on PATH)."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


class PySpy:
    """`py-spy record` of a process from now until `stop`, in raw (collapsed stack) form."""

    def __init__(self, binary: str, pid: int, out: Path) -> None:
        self.out = out
        self.command = [
            binary,
            "record",
            "--pid",
            str(pid),
            "--rate",
            "200",
            "--format",
            "raw",
            "--nonblocking",
            "--output",
            str(out),
        ]
        self._process = subprocess.Popen(
            self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )

    def stop(self) -> dict[str, Any]:
        """Stop recording (py-spy writes its output on SIGINT) and summarise."""
        self._process.send_signal(signal.SIGINT)
        try:
            _, stderr = self._process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self._process.kill()
            return {"error": "py-spy did not stop"}
        if not self.out.exists():
            return {"error": stderr.strip()[-500:] or f"py-spy exited {self._process.returncode}"}
        summary = collapsed_summary(self.out.read_text())
        summary["command"] = shlex.join(["py-spy", *self.command[1:-1], "raw.txt"])
        return summary


# Areas whose share of the (busy) samples is reported even when they are not a frame's leaf.
LAYERS = (
    "quota_service/api",
    "quota_service/core",
    "quota_service/store",
    "quota_service/jobs",
    "sqlalchemy",
    "psycopg",
    "grpc",
    "google",
    "logging",
    "prometheus_client",
)


def _frame_area(frame: str) -> str:
    """Where a frame's code lives: a part of kvquota, a package, or a standard module (py-spy
    gives file names relative to their sys.path entry)."""
    match = re.search(r"\(([^)]*?)(?::\d+)?\)$", frame)
    path = match.group(1) if match else frame
    if "quota_service/" in path:
        part = path.split("quota_service/", 1)[1].split("/")[0]
        return "quota_service/" + part.removesuffix(".py")
    if "kvquota/v1" in path:
        return "kvquota/v1"
    if "grpc" in path:
        return "grpc"
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    return path.split("/")[0].removesuffix(".py")


def _waiting(frame: str) -> bool:
    """The event loop waiting for I/O (py-spy's --nonblocking sampling counts it as busy)."""
    return frame.startswith(("EpollSelector.select", "select (selectors"))


def collapsed_summary(raw: str, top: int = 15) -> dict[str, Any]:
    """Of the busy samples (not the event loop waiting in epoll): the top frames by own samples,
    the own samples by area, and the share of samples each layer is on the stack of."""
    own: Counter[str] = Counter()
    own_area: Counter[str] = Counter()
    layers: Counter[str] = Counter()
    busy = waiting = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        if _waiting(frames[-1]):
            waiting += count
            continue
        busy += count
        own[frames[-1]] += count
        own_area[_frame_area(frames[-1])] += count
        for layer in {a for a in map(_frame_area, frames) if a.startswith(LAYERS)}:
            layers[layer] += count
    share = 100 / busy if busy else 0
    return {
        "busy_samples": busy,
        "epoll_wait_samples": waiting,
        "top_own": [(frame, round(n * share, 1)) for frame, n in own.most_common(top)],
        "own_by_area": [(a, round(n * share, 1)) for a, n in own_area.most_common(top)],
        "layers": [(a, round(n * share, 1)) for a, n in layers.most_common()],
    }

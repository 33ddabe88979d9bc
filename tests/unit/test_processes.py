"""No process a test starts outlives it (tests/processes.py, tests/conftest.py): not when the
test passes, not when it fails, not when pytest-timeout ends it (in an asyncio test too, whose
own finally never runs), and not its children either. Checked on a pytest run of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests import processes

ROOT = Path(__file__).resolve().parents[2]

# Each test starts a shell whose own child sleeps too (the group must go, not only the shell) and
# writes the group's id where the outer test finds it.
INNER = """
import asyncio
import os
import subprocess
import time
from pathlib import Path

from tests import processes

GROUPS = Path(os.environ["GROUPS_FILE"])


def sleeper() -> subprocess.Popen[str]:
    process = processes.popen(["sh", "-c", "sleep 600 & sleep 600"])
    with GROUPS.open("a") as groups:
        groups.write(f"{process.pid}\\n")
    return process


def test_stops_its_process() -> None:
    processes.stop(sleeper())


def test_times_out() -> None:
    sleeper()
    time.sleep(600)


async def test_times_out_in_asyncio() -> None:
    process = sleeper()
    try:
        await asyncio.sleep(600)
    finally:
        processes.stop(process)  # never runs: the timeout leaves the coroutine where it waits


def test_fails() -> None:
    sleeper()
    raise AssertionError("failed on purpose")


def test_passes_but_leaves_its_process() -> None:
    sleeper()
"""


def test_no_process_outlives_its_test(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER))
    groups = tmp_path / "groups"
    pytest = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")]
    ran = subprocess.run(
        [*pytest, "-p", "tests.conftest", "-p", "no:cacheprovider", "--timeout=2", "-rA", tmp_path],
        cwd=ROOT,
        env={**os.environ, "GROUPS_FILE": str(groups)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    # The short summary (-rA): a line per outcome of each test, teardown errors too.
    outcomes = {
        tuple(line.split(" - ")[0].split(" test_inner.py::")) for line in ran.stdout.splitlines()
    }
    assert outcomes >= {
        ("PASSED", "test_stops_its_process"),
        ("FAILED", "test_times_out"),
        ("FAILED", "test_times_out_in_asyncio"),
        ("FAILED", "test_fails"),
        # Its process was killed after it, and the test fails for having left it.
        ("PASSED", "test_passes_but_leaves_its_process"),
        ("ERROR", "test_passes_but_leaves_its_process"),
    }, ran.stdout
    assert "3 failed, 2 passed, 1 error" in ran.stdout, ran.stdout
    pgids = [int(line) for line in groups.read_text().split()]
    assert len(pgids) == 5
    assert not [pgid for pgid in pgids if processes.running(pgid)]

"""The repository's code and docs say what they mean, not which tracker entry asked for it: an
issue's number means nothing to someone reading the code later."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRACKER_REFERENCE = re.compile(r"\bissues? #?\d+|(?<![\w&/])#\d{1,4}\b", re.IGNORECASE)
TEXT_SUFFIXES = {".py", ".md", ".proto", ".toml", ".yaml", ".yml", ".sh", ".cfg", ".ini"}


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    files = [ROOT / name for name in listed]
    return [
        f
        for f in files
        if f.is_file()
        and (f.suffix in TEXT_SUFFIXES or f.name in ("Makefile", "run"))
        and "_pb2" not in f.name
    ]


def test_no_tracker_numbers_in_code_or_docs() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in tracked_text_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if TRACKER_REFERENCE.search(line)
    ]
    assert not found, "\n".join(found)


def test_a_tracker_number_is_found() -> None:
    # Built here, so that this file holds no reference itself.
    assert TRACKER_REFERENCE.search("as issue " + "19 asked")
    assert TRACKER_REFERENCE.search("fixed in " + "#" + "123")
    assert not TRACKER_REFERENCE.search("color: #fff; list[0]; &#39;")

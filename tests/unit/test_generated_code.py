"""The committed Python for proto/kvquota/v1 is what `make proto` generates now."""

from __future__ import annotations

import filecmp
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("protogen", ROOT / "scripts" / "protogen.py")
    assert spec is not None and spec.loader is not None
    protogen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(protogen)
    protogen.generate(tmp_path)
    committed = ROOT / "kvquota" / "v1"
    fresh = tmp_path / "kvquota" / "v1"
    names = sorted(p.name for p in fresh.iterdir())
    assert names == sorted(p.name for p in committed.iterdir() if p.name != "__pycache__")
    _, mismatch, errors = filecmp.cmpfiles(committed, fresh, names, shallow=False)
    assert (mismatch, errors) == ([], []), "generated code is stale: run `make proto`"

"""What `make proto` generates is committed as it generates it now: the Python for
proto/kvquota/v1, core's Reason enum, and the README's error table."""

from __future__ import annotations

import filecmp
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def protogen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("protogen", ROOT / "scripts" / "protogen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(protogen: ModuleType, tmp_path: Path) -> None:
    protogen.generate(tmp_path)
    committed = ROOT / "kvquota" / "v1"
    fresh = tmp_path / "kvquota" / "v1"
    names = sorted(p.name for p in fresh.iterdir())
    assert names == sorted(p.name for p in committed.iterdir() if p.name != "__pycache__")
    _, mismatch, errors = filecmp.cmpfiles(committed, fresh, names, shallow=False)
    assert (mismatch, errors) == ([], []), "generated code is stale: run `make proto`"


def test_reasons_and_the_error_table_follow_the_proto(protogen: ModuleType) -> None:
    reasons = protogen.error_reasons(protogen.descriptor_set())
    stale = "stale: run `make proto`"
    assert protogen.REASONS_MODULE.read_text() == protogen.reasons_module(reasons), stale
    readme = protogen.README.read_text()
    assert protogen.readme_with(protogen.error_table(reasons), readme) == readme, stale

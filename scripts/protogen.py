"""Generate the Python code for proto/kvquota/v1 into a directory (the repository root by default).

One script for `make proto` and for the test that fails when the committed code is stale.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out: Path) -> None:
    sources = sorted(
        str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "kvquota" / "v1").glob("*.proto")
    )
    well_known = str(resources.files("grpc_tools") / "_proto")
    # mypy-protobuf's plugins type the messages and the gRPC stubs and servicers (sync and aio).
    plugins = Path(sys.executable).parent
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={plugins / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={plugins / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out}",
        f"--mypy_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_grpc_out={out}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for package in (out / "kvquota", out / "kvquota" / "v1"):
        init = package / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated from proto/kvquota; run `make proto` to regenerate."""\n')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    main()

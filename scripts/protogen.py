"""Generate the Python code for proto/kvquota/v1 into a directory (the repository root by default),
and what follows from kvquota.v1.ErrorReason: core's Reason enum with each reason's status code
(quota_service/core/reasons.py) and the README's error table.

One script for `make proto` and for the test that fails when the committed code is stale.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.rpc import code_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
REASONS_MODULE = ROOT / "quota_service" / "core" / "reasons.py"
README = ROOT / "README.md"
ERROR_REASON_PROTO = "kvquota/v1/error_reason.proto"
TABLE_START = "<!-- error table: `make proto` writes it from kvquota.v1.ErrorReason -->"
TABLE_END = "<!-- end of the error table -->"
INCLUDES = (
    f"-I{PROTO_DIR}",
    f"-I{resources.files('grpc_tools') / '_proto'}",
    # googleapis-common-protos ships google/api and google/rpc next to their Python code.
    f"-I{Path(code_pb2.__file__).resolve().parents[2]}",
)


def sources() -> list[str]:
    return sorted(
        str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "kvquota" / "v1").glob("*.proto")
    )


def descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    """Every kvquota proto and what it imports, with its comments (for tests and tables)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kvquota.pb"
        args = [
            "protoc",
            *INCLUDES,
            f"--descriptor_set_out={out}",
            "--include_imports",
            "--include_source_info",
            *sources(),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def generate(out: Path) -> None:
    # mypy-protobuf's plugins type the messages and the gRPC stubs and servicers (sync and aio).
    plugins = Path(sys.executable).parent
    args = [
        "protoc",
        *INCLUDES,
        f"--plugin=protoc-gen-mypy={plugins / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={plugins / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out}",
        f"--mypy_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_grpc_out={out}",
        *sources(),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for package in (out / "kvquota", out / "kvquota" / "v1"):
        init = package / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated from proto/kvquota; run `make proto` to regenerate."""\n')


@dataclass(frozen=True)
class ReasonDoc:
    """One ErrorReason value: its name, its ErrorMapping, and its comment on one line."""

    name: str
    code: str
    http_status: int
    retry_after: bool
    metadata_keys: tuple[str, ...]
    comment: str


def error_reasons(files: descriptor_pb2.FileDescriptorSet) -> list[ReasonDoc]:
    """ErrorReason's values in order, the unspecified one left out. Options are read through a
    pool of their own, so that a stale generated module never stands in for the proto."""
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    options = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("google.protobuf.EnumValueOptions")
    )
    extension = pool.FindExtensionByName("kvquota.v1.error_mapping")
    (file,) = (f for f in files.file if f.name == ERROR_REASON_PROTO)
    index = [e.name for e in file.enum_type].index("ErrorReason")
    comments = {tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location}
    docs = []
    # Source paths: 5 is FileDescriptorProto.enum_type, 2 EnumDescriptorProto.value.
    for number, value in enumerate(file.enum_type[index].value):
        parsed: Any = options.FromString(value.options.SerializeToString())
        if not parsed.HasExtension(extension):
            continue
        mapping = parsed.Extensions[extension]
        docs.append(
            ReasonDoc(
                value.name,
                code_pb2.Code.Name(mapping.code),
                mapping.http_status,
                mapping.retry_after,
                tuple(mapping.metadata_keys),
                " ".join(comments.get((5, index, 2, number), "").split()),
            )
        )
    return docs


def reasons_module(reasons: list[ReasonDoc]) -> str:
    members = "".join(f'    {r.name} = "{r.name}"\n' for r in reasons)
    codes = "".join(f'    Reason.{r.name}: "{r.code}",\n' for r in reasons)
    return f'''"""Why kvquota refuses a call: kvquota.v1.ErrorReason (in error_reason.proto), each
reason with the gRPC status code it always comes with, by its name.

Generated by `make proto` from the proto: edit the proto, not this file.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class Reason(enum.StrEnum):
    """An ErrorInfo reason: its value is the name on the wire."""

{members}

STATUS_CODES: Mapping[Reason, str] = {{
{codes}}}
'''


def _http(reason: ReasonDoc) -> str:
    return f"{reason.http_status} + Retry-After" if reason.retry_after else str(reason.http_status)


def error_table(reasons: list[ReasonDoc]) -> str:
    rows = [
        f"| {r.name} | {r.code} | {_http(r)} | "
        f"{', '.join(f'`{k}`' for k in r.metadata_keys)} | {r.comment} |"
        for r in reasons
    ]
    header = ["| reason | gRPC code | HTTP | metadata | when |", "|---|---|---|---|---|"]
    return "\n".join([TABLE_START, *header, *rows, TABLE_END])


def readme_with(table: str, readme: str) -> str:
    """The README with its error table replaced by `table`."""
    pattern = re.compile(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), re.DOTALL)
    if not pattern.search(readme):
        raise SystemExit(f"README.md has no {TABLE_START} ... {TABLE_END} section")
    return pattern.sub(lambda _: table, readme)


def lint() -> None:
    """`buf lint` (buf.yaml's rules) on the kvquota protos, from an image protoc builds."""
    with tempfile.TemporaryDirectory() as tmp:
        image = Path(tmp) / "image.binpb"
        image.write_bytes(descriptor_set().SerializeToString())
        buf = Path(sys.executable).parent / "buf"
        config = ROOT / "buf.yaml"
        args = [str(buf), "lint", str(image), "--config", str(config), "--path", "kvquota/v1"]
        if subprocess.run(args, check=False).returncode != 0:
            raise SystemExit("buf lint found faults in proto/kvquota/v1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT)
    parser.add_argument("--lint", action="store_true", help="only lint the protos (buf lint)")
    args = parser.parse_args()
    if args.lint:
        lint()
        return
    generate(args.out)
    reasons = error_reasons(descriptor_set())
    REASONS_MODULE.write_text(reasons_module(reasons))
    README.write_text(readme_with(error_table(reasons), README.read_text()))


if __name__ == "__main__":
    main()

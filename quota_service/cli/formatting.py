"""Values as the commands print and read them: tables, proto JSON, enum names, sizes."""

from __future__ import annotations

import argparse
import json
import re

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

SIZE_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def table_lines(rows: list[dict[str, object]]) -> list[str]:
    """Rows as aligned columns under a header of their keys in upper case."""
    columns = list(rows[0]) if rows else ["name"]
    widths = {c: max([len(c), *(len(str(r[c])) for r in rows)]) for c in columns}
    header = "  ".join(c.upper().ljust(widths[c]) for c in columns)
    return [header, *("  ".join(str(r[c]).ljust(widths[c]) for c in columns) for r in rows)]


def print_rows(rows: list[dict[str, object]]) -> None:
    print("\n".join(table_lines(rows)))


def print_json(value: object) -> None:
    print(json.dumps(value, indent=2))


def as_dict(message: Message) -> dict[str, object]:
    """Proto JSON, zeros and empty fields included: a script reading `expectedBlocks` should
    find 0 there, not nothing."""
    return MessageToDict(message, always_print_fields_with_no_presence=True)


def enum_name(message: Message, field: str) -> str:
    """`TENANT_STATE_ACTIVE` → `ACTIVE`: the value's name without its enum's prefix
    (the enum's name in upper snake case, as the proto style guide has it)."""
    descriptor = message.DESCRIPTOR.fields_by_name[field].enum_type
    assert descriptor is not None
    name = descriptor.values_by_number[getattr(message, field)].name
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", descriptor.name).upper() + "_"
    return name.removeprefix(prefix)


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '4096' (bytes) → bytes."""
    match = re.fullmatch(r"(\d+)\s*([KMGT]iB|B)?", text.strip(), re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 4096)")
    return int(match.group(1)) * SIZE_UNITS[(match.group(2) or "").upper()]


def format_size(size: int) -> str:
    """Bytes in the largest binary unit that keeps a whole number above 1, e.g. 1.5GiB."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = SIZE_UNITS[unit.upper()]
        if size >= scale:
            return f"{size / scale:.3g}{unit}"
    return f"{size}B"

"""The journal binds its own statements' parameters as SQL literals (store/journal.py, `_literal`):
each reads back in PostgreSQL as the value it was made from. A value of a kind it does not make,
and any value on a connection under the old quoting (standard_conforming_strings off), is bound
by the driver instead."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from quota_service.store.journal import _literal, _Unbound, _Writer

READ_BACK: list[tuple[str, Any]] = [
    ("text", "plain"),
    ("text", "it's"),
    ("text", "back\\slash, \\' and ''"),
    ("text", "ünïcødé ✓"),
    ("text", '[{"tenant": "a\'b", "note": "a \\"quoted\\" {brace}"}]'),
    ("text", ""),
    ("bigint", 2**62),
    ("bigint", -5),
    ("bytea", b"\x00\x01\xfe'\\x"),
    ("text[]", ["t0", "it's", 'say "hi"', "back\\slash", "a,b", "{x}", "", "NULL", " pad "]),
    ("text[]", []),
    ("text", None),
]


def test_each_literal_reads_back_as_its_value(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as connection:
        for kind, value in READ_BACK:
            row = connection.execute(f"SELECT {_literal(value)}::{kind}").fetchone()
            assert row is not None
            assert row[0] == value, (kind, value)


@pytest.mark.parametrize("value", ["nul\0inside", True, 1.5, [1, 2], ["a", 1], {"a": 1}])
def test_other_kinds_are_left_to_the_driver(value: Any) -> None:
    with pytest.raises(_Unbound):
        _literal(value)


@pytest.mark.parametrize("conforming", ["on", "off"])
async def test_a_writer_binds_under_either_quoting(database_url: str, conforming: str) -> None:
    """Under the old quoting a backslash in a literal is an escape: the driver binds there."""
    connection = await psycopg.AsyncConnection.connect(
        database_url, autocommit=True, options=f"-c standard_conforming_strings={conforming}"
    )
    try:
        writer = _Writer(connection)
        sql = "SELECT %(text)s::text, %(tenants)s::text[], %(epoch)s::bigint"
        for prepare in writer.prepare([sql]):
            await connection.execute(prepare)
        params = {"text": "a\\'b\\\\c", "tenants": ["x\\y", "it's"], "epoch": 7}
        bound = writer.bound(sql, params)
        cursor = await connection.execute(bound)
        assert await cursor.fetchone() == ("a\\'b\\\\c", ["x\\y", "it's"], 7)
        # A parameter the writer does not make a literal of goes to the driver.
        bound = writer.bound(sql, {**params, "epoch": 7.0})
        cursor = await connection.execute(bound)
        assert await cursor.fetchone() == ("a\\'b\\\\c", ["x\\y", "it's"], 7)
    finally:
        await connection.close()

"""The tests' databases on one PostgreSQL server: copies of the migrated template, made ahead and
dropped behind by background threads. CREATE DATABASE writes the whole copy to the WAL; DROP
DATABASE waits for a checkpoint, which flushes the whole server and, with every test (of every
suite using the server) asking for its own, took seconds. A test takes a copy made while the one
before it ran, and its own is dropped while the next ones run."""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import psycopg
from sqlalchemy import make_url

# Drops at once: they share checkpoints, but each holds a connection of the server's hundred,
# which other workers and suites need too.
DROPPING = 4


class Databases:
    def __init__(self, server_url: str, prepare: Callable[[str], None]) -> None:
        """A template database, made ready by `prepare` (given its URL)."""
        self.server_url = server_url
        self._copies = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-copies")
        self._drops = ThreadPoolExecutor(max_workers=DROPPING, thread_name_prefix="test-drops")
        self._spares: deque[Future[str]] = deque()
        self._dropped: list[Future[None]] = []
        self.template = self.create(None)
        prepare(self.url(self.template))

    def url(self, name: str) -> str:
        return make_url(self.server_url).set(database=name).render_as_string(hide_password=False)

    def _admin(self, sql: str) -> None:
        with psycopg.connect(self.server_url, autocommit=True) as conn:
            conn.execute(sql)

    def create(self, template: str | None) -> str:
        """A new database copied from `template` (nothing may be connected to it), or an empty
        one (None); returns its name."""
        name = f"kvq_test_{uuid.uuid4().hex[:12]}"
        copied = "" if template is None else f' TEMPLATE "{template}"'
        self._admin(f'CREATE DATABASE "{name}"{copied}')
        return name

    def take(self) -> str:
        """A fresh copy of the template (its name); the next one is started meanwhile."""
        while len(self._spares) < 2:
            self._spares.append(self._copies.submit(self.create, self.template))
        return self._spares.popleft().result()

    def drop(self, name: str) -> None:
        """Drops the database in the background (close() waits for it)."""
        self._dropped.append(
            self._drops.submit(self._admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        )

    @contextmanager
    def fresh(self) -> Iterator[str]:
        """A fresh copy of the template, as a URL, dropped afterwards."""
        name = self.take()
        try:
            yield self.url(name)
        finally:
            self.drop(name)

    def close(self) -> None:
        """Drops the spare copies and the template too, and waits for every drop; raises the
        first that failed."""
        try:
            while self._spares:
                self.drop(self._spares.popleft().result())
        finally:
            self._copies.shutdown(wait=True)
        self.drop(self.template)
        self._drops.shutdown(wait=True)
        for dropped in self._dropped:
            dropped.result()

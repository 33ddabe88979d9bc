"""The suite's results as a terminal table and as docs/benchmarks.md. The hand-written analysis
between the ANALYSIS markers of an existing report is kept when the report is written again."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from bench.load import warmup_seconds

BEGIN, END = "<!-- BEGIN ANALYSIS -->", "<!-- END ANALYSIS -->"
_NO_ANALYSIS = (
    "_No analysis yet: write it here; `python -m bench.suite` keeps what is between these "
    "markers when it writes this file again._"
)

# figure key: (label, unit, decimals)
LABELS: dict[str, tuple[str, str, int]] = {
    "pgbench_tps": ("pgbench -N, best of the client counts", "tps", 0),
    "grpc_floor_pairs_per_second": ("bare gRPC floor (bench/grpc_floor.py), best", "pairs/s", 1),
    "grpc_floor_server_cpu_ms_per_pair": ("  its server CPU per pair", "ms", 2),
    "pairs_per_second_no_prefix": ("Admit+Release, no prefix, best", "pairs/s", 1),
    "best_concurrency_no_prefix": ("  at clients", "", 0),
    "ratio_no_prefix": ("  ÷ pgbench -N tps", "", 3),
    "of_grpc_floor_no_prefix": ("  ÷ bare gRPC floor", "", 3),
    "pairs_per_second_prefix": ("Admit+Release, 1024-token prefix, best", "pairs/s", 1),
    "best_concurrency_prefix": ("  at clients", "", 0),
    "ratio_prefix": ("  ÷ pgbench -N tps", "", 3),
    "of_grpc_floor_prefix": ("  ÷ bare gRPC floor", "", 3),
    "server_cpu_of_grpc_floor_no_prefix": ("server CPU per pair ÷ the floor's (no prefix)", "", 2),
    "server_cpu_of_grpc_floor_prefix": ("server CPU per pair ÷ the floor's (prefix)", "", 2),
    "server_cpu_ms_per_pair_no_prefix": ("server CPU per pair (best, no prefix)", "ms", 2),
    "postgres_cpu_ms_per_pair_no_prefix": ("PostgreSQL CPU per pair (best, no prefix)", "ms", 2),
    "driver_cpu_ms_per_pair_no_prefix": ("load generator CPU per pair (no prefix)", "ms", 2),
    "server_cpu_ms_per_pair_prefix": ("server CPU per pair (best, prefix)", "ms", 2),
    "postgres_cpu_ms_per_pair_prefix": ("PostgreSQL CPU per pair (best, prefix)", "ms", 2),
    "driver_cpu_ms_per_pair_prefix": ("load generator CPU per pair (prefix)", "ms", 2),
    "operations_per_commit_no_prefix": ("operations per commit, most clients, no prefix", "", 1),
    "operations_per_commit_prefix": ("operations per commit, most clients, prefix", "", 1),
    "forwarded_pairs_per_second": ("forwarded: most clients calling a non-owner", "pairs/s", 1),
    "forwarded_admit_p50_ms": ("  Admit p50", "ms", 2),
    "forwarded_admit_p99_ms": ("  Admit p99", "ms", 2),
    "forwarding_cpu_ms_per_pair": ("  the forwarding replica's CPU per pair", "ms", 2),
    "forwarded_owner_cpu_ms_per_pair": ("  the owner's CPU per pair", "ms", 2),
    "fleet_pairs_per_second": ("fleet: most clients over 8 instances, 16 tenants", "pairs/s", 1),
    "fleet_ratio": ("  ÷ pgbench -N tps", "", 3),
    "fleet_admit_p50_ms": ("  Admit p50", "ms", 2),
    "fleet_admit_p99_ms": ("  Admit p99", "ms", 2),
    "fleet_server_cpu_ms_per_pair": ("  server CPU per pair", "ms", 2),
    "fleet_postgres_cpu_ms_per_pair": ("  PostgreSQL CPU per pair", "ms", 2),
    "fleet_of_one_instance": ("  ÷ one instance's best (no prefix)", "", 2),
    "half_no_prefix_rate": ("half load, no prefix: offered", "pairs/s", 1),
    "half_no_prefix_achieved": ("  achieved", "pairs/s", 1),
    "half_no_prefix_admit_p50_ms": ("  Admit p50", "ms", 2),
    "half_no_prefix_admit_p99_ms": ("  Admit p99", "ms", 2),
    "half_prefix_rate": ("half load, prefix: offered", "pairs/s", 1),
    "half_prefix_achieved": ("  achieved", "pairs/s", 1),
    "half_prefix_admit_p50_ms": ("  Admit p50", "ms", 2),
    "half_prefix_admit_p99_ms": ("  Admit p99", "ms", 2),
    "pool_small_admit_p50_ms": ("1,000-slot pool, 1 client: Admit p50", "ms", 2),
    "pool_small_admit_p99_ms": ("  Admit p99", "ms", 2),
    "pool_big_admit_p50_ms": ("1,000,000-slot pool, 1 client: Admit p50", "ms", 2),
    "pool_big_admit_p99_ms": ("  Admit p99", "ms", 2),
    "pool_ratio_p50": ("  p50 ratio big ÷ small", "", 2),
    "pool_ratio_p99": ("  p99 ratio big ÷ small", "", 2),
    "pool_big_in_use_admit_p50_ms": ("1,000,000-slot pool 90% in use: Admit p50", "ms", 2),
    "pool_big_in_use_admit_p99_ms": ("  Admit p99", "ms", 2),
    "pool_big_in_use_prefix_admit_p50_ms": ("  with the 1024-token prefix: Admit p50", "ms", 2),
    "pool_big_in_use_prefix_admit_p99_ms": ("  Admit p99", "ms", 2),
    "queue_pairs_per_second": ("queue mix (4 tenants, room for 10): pairs/s", "pairs/s", 1),
    "queue_queued_percent": ("  Admits that queued", "%", 1),
    "queue_wait_p50_ms": ("  queue wait p50", "ms", 1),
    "queue_wait_p99_ms": ("  queue wait p99", "ms", 1),
    "queue_timeouts": ("  queue timeouts", "", 0),
    "queue_share_q0_percent": ("  share of q0 (weight 1 = 12.5%)", "%", 1),
    "queue_share_q1_percent": ("  share of q1 (weight 1 = 12.5%)", "%", 1),
    "queue_share_q2_percent": ("  share of q2 (weight 2 = 25%)", "%", 1),
    "queue_share_q3_percent": ("  share of q3 (weight 4 = 50%)", "%", 1),
    "offboard_seconds": ("offboarding (DeleteTenant)", "s", 2),
    "offboard_blocks": ("  blocks the tenant held", "", 0),
    "offboard_freed_blocks": ("  blocks freed", "", 0),
    "reclaim_plan_seconds": ("reclaim plan (dry run) over the big pool", "s", 2),
    "auth_pairs_per_second": ("API keys required: pairs/s (best clients)", "pairs/s", 1),
    "auth_admit_p50_ms": ("  Admit p50", "ms", 2),
    "no_auth_pairs_per_second": ("  then without authentication: pairs/s", "pairs/s", 1),
    "no_auth_admit_p50_ms": ("  Admit p50", "ms", 2),
    "server_rss_hot_path_mib": ("server VmRSS, peak during the run's loads", "MiB", 1),
    "server_peak_rss_mib": ("server VmHWM at the end (reclaim plan included)", "MiB", 1),
}


def _number(value: float, decimals: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{decimals}f}"


def _pool(pool: dict[str, int] | None) -> str:
    if not pool:
        return "pool not filled"
    return (
        f"the pool then: {pool['in_use']:,} blocks in use, {pool['cached']:,} cached, "
        f"{pool['free']:,} free; {pool['live_sessions']:,} live sessions, "
        f"{pool['suspended_sessions']:,} of them suspended"
    )


def _sig(value: float | None) -> str:
    """Three significant digits (a ratio of 0.006 must not print as 0.01)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if value == 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def _figure_rows(document: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    rows = []
    figures = document["figures"]
    ordered = [k for k in LABELS if k in figures] + [k for k in figures if k not in LABELS]
    for key in ordered:
        label, unit, decimals = LABELS.get(key, (key, "", 2))
        stats = figures[key]
        rows.append(
            (
                label,
                unit,
                _number(stats["min"], decimals),
                _number(stats["median"], decimals),
                _number(stats["max"], decimals),
            )
        )
    return rows


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "NOT MET")


def table(document: dict[str, Any]) -> str:
    settings = document["settings"]
    out = [
        f"kvquota benchmarks, {document['date']}: {settings['runs']} run(s) of "
        f"{settings['seconds']:g} s per point, {settings['servers']} server process(es), "
        f"authentication {settings['auth']}",
        "",
        f"{'target':<72} {'min':>9} {'median':>9} {'max':>9}  verdict",
    ]
    for v in document["targets"]:
        out.append(
            f"{v['text']:<72} {_sig(v.get('min')):>9} "
            f"{_sig(v['median']):>9} {_sig(v.get('max')):>9}  {_verdict(v['met'])}"
        )
    out += ["", f"{'figure':<52} {'unit':>8} {'min':>10} {'median':>10} {'max':>10}"]
    for label, unit, low, mid, high in _figure_rows(document):
        out.append(f"{label:<52} {unit:>8} {low:>10} {mid:>10} {high:>10}")
    return "\n".join(out)


def _md_table(header: list[str], rows: list[list[str]], align: str | None = None) -> list[str]:
    align = align or "l" + "r" * (len(header) - 1)
    marks = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(marks) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _kept_analysis(path: Path) -> str:
    if path.exists():
        found = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), path.read_text(), re.S)
        if found:
            return found.group(1).rstrip("\n")
    return _NO_ANALYSIS


def markdown(document: dict[str, Any], analysis: str) -> str:
    s = document["settings"]
    sizes = s["sizes"]
    machine = document["machine"]
    extra = document["extra"]
    out = [
        "# Benchmarks",
        "",
        f"Measured {document['date']} (UTC) by `{document['command']}`"
        f"{' (the --quick smoke form: not a measurement)' if s['quick'] else ''}. "
        f"{s['runs']} run(s); each load point lasts {s['seconds']:g} s after a "
        f"{warmup_seconds(s['seconds']):g} s warm-up; "
        "each figure is given as min / median / max over the runs, and a target is met when "
        "its median is. The development machine is shared: treat the figures as indicative "
        "unless the load average was low.",
        "",
        "## How to run",
        "",
        "```sh",
        "make bench                       # this suite, then bench.kv_events, bench.usage_export",
        "python -m bench.suite            # --runs 3 --seconds 10 --concurrency 1 4 16 32",
        "python -m bench.suite --servers 2 --auth both   # two server processes; auth on and off",
        "python -m bench.suite --quick --docs ''         # the smoke form the tests run",
        "python -m bench.instructions     # instructions per pair (callgrind), against the floor",
        "```",
        "",
        "How far the ledger drifts from a real vLLM under a mixed load (blocks and prefix hits "
        "per request, cached sets after each phase) is measured by `make bench-fidelity`: "
        "[benchmarks-fidelity.md](benchmarks-fidelity.md). The instance state machine beside "
        "vLLM's KVCacheManager: [benchmarks-state-machine.md](benchmarks-state-machine.md).",
        "",
        "PostgreSQL is `KVQUOTA_DATABASE_URL`'s server, else 127.0.0.1:5432, else an embedded "
        "one. The suite makes a throwaway database, migrates it, starts `kvquota serve` "
        "process(es) on it and drives them over gRPC from its own process (the load generator); "
        "pgbench runs on another throwaway database of the same server, for the same duration "
        "per point. Authentication: "
        + {
            "on": "API keys required, as in production (the suite makes an admin key and "
            "sends `authorization: Bearer …` with every call; verified keys are cached).",
            "off": "off (KVQUOTA_AUTH_REQUIRED=false): every figure is without API keys.",
            "both": "API keys required, as in production; the best load point is measured "
            "again against servers without authentication.",
        }[s["auth"]],
        "",
        "## Machine",
        "",
        *_md_table(
            ["", ""],
            [[k, str(v)] for k, v in machine.items()],
            "ll",
        ),
        "",
        "## Set-up",
        "",
        f"- kvquota: {s['servers']} server process(es), connection pool "
        f"{s['db_pool_size']} per process; clients spread round-robin over the servers.",
        f"- Requests: 1280 prompt + 256 output tokens = 96 blocks of 16; the prefix form sends "
        f"the prompt's token ids, its first 1024 tokens shared by every request of a tenant (64 "
        f"prefix blocks), the rest unique (16 prompt blocks cached when released, 16 output "
        f"blocks). Four tenants; closed loop at clients {', '.join(map(str, s['concurrency']))}, "
        f"on an instance of {max(8192, 2 * max(s['concurrency']) * 96):,} slots.",
        "- Half load: open loop, Poisson arrivals at half of that run's best pairs/s; each "
        "Admit is timed from when it was due.",
        f"- Pool size: one client, no prefix, on instances of {sizes['small_pool']:,} and "
        f"{sizes['big_pool']:,} slots (registered with one row per slot; the big one took "
        f"{extra.get('register_big_pool_seconds', '?')} s).",
        "- Queue mix: 48 clients, 12 each of tenants q0..q3 (weights 1, 1, 2, 4; every tenant "
        "keeps more requests waiting than its share of the slots), on an instance of 960 "
        "slots (10 requests); each holds its reservation 50 ms and waits up to 10 s.",
        f"- Offboarding: a new tenant admits {sizes['offboard_blocks']:,} blocks' worth of "
        "requests (long leases), then DeleteTenant is timed.",
        f"- Reclaim plan: the {sizes['big_pool']:,}-slot pool filled with sessions of 2,048 "
        "blocks (10% released with token ids, so cached; 80% live, every fourth suspended), "
        f"then CreateReclaimJob (dry_run, target 90% of the pool, up to EVICT) timed; fill "
        f"took {extra.get('reclaim_fill_seconds', '?')} s; {_pool(extra.get('reclaim_pool'))}.",
        "",
        "pgbench, on a throwaway database of the same PostgreSQL server:",
        "",
        "```sh",
        extra.get("pgbench_init", "?"),
        *dict.fromkeys(
            p["command"]
            for r in document["runs"]
            for p in sorted(r["pgbench"], key=lambda p: p["clients"])
        ),
        "```",
        "",
        "## Targets",
        "",
        *_md_table(
            ["target", "min", "median", "max", "verdict", "median ÷ limit"],
            [
                [
                    v["text"],
                    _sig(v.get("min")),
                    _sig(v["median"]),
                    _sig(v.get("max")),
                    _verdict(v["met"]),
                    _sig(v.get("of_limit")),
                ]
                for v in document["targets"]
            ],
            "lrrrlr",
        ),
        "",
        "## Figures",
        "",
        *_md_table(
            ["figure", "unit", "min", "median", "max"],
            [list(r) for r in _figure_rows(document)],
            "llrrr",
        ),
        "",
        "## Load points",
        "",
        *_md_table(
            [
                "run",
                "prefix",
                "clients",
                "pairs/s",
                "Admit p50 ms",
                "Admit p99 ms",
                "Release p50 ms",
                "refused",
                "server CPU ms/pair",
                "PostgreSQL CPU ms/pair",
                "generator CPU ms/pair",
                "operations per commit",
            ],
            [
                [
                    str(n + 1),
                    str(p["prefix_tokens"]),
                    str(p["concurrency"]),
                    _number(p["pairs_per_second"], 1),
                    _number(p["admit_p50_ms"]),
                    _number(p["admit_p99_ms"]),
                    _number(p["release_p50_ms"]),
                    str(p["refused"]),
                    _number(p["server_cpu_ms_per_pair"]),
                    _number(p["postgres_cpu_ms_per_pair"]),
                    _number(p["driver_cpu_ms_per_pair"]),
                    _number(p.get("operations_per_commit", math.nan), 1),
                ]
                for n, r in enumerate(document["runs"])
                for p in r["points"]
            ],
        ),
        "",
        "What the servers' PostgreSQL connections were doing during each point (sampled from "
        "pg_stat_activity every 50 ms; average number of connections in each state, idle "
        "ones not counted):",
        "",
        *_md_table(
            ["run", "prefix", "clients", "connections"],
            [
                [
                    str(n + 1),
                    str(p["prefix_tokens"]),
                    str(p["concurrency"]),
                    "; ".join(f"{_short(k)} {v}" for k, v in p.get("connections", {}).items()),
                ]
                for n, r in enumerate(document["runs"])
                for p in r["points"]
            ],
            "rrrl",
        ),
        "",
        *_md_table(
            ["run", "pgbench -N clients", "tps", "latency ms"],
            [
                [str(n + 1), str(p["clients"]), _number(p["tps"], 0), _number(p["latency_ms"])]
                for n, r in enumerate(document["runs"])
                for p in r["pgbench"]
            ],
        ),
        "",
        *_profile_section(extra),
        "## Analysis",
        "",
        BEGIN,
        analysis,
        END,
        "",
    ]
    notes = [note for r in document["runs"] for note in r["notes"]]
    if notes:
        out += ["## Notes from the runs", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(out)


def _short(state: str) -> str:
    if state.startswith("running a statement (on CPU"):
        return "on CPU"
    if state.startswith("in a transaction"):
        return "in a transaction, awaiting its next statement"
    return state.removeprefix("running a statement, waiting for ")


def _spy(title: str, spy: dict[str, Any] | None) -> list[str]:
    if not spy:
        return []
    if "error" in spy:
        return [f"{title}: py-spy: {spy['error']}", ""]
    return [
        f"**{title}** (`{spy.get('command', '')}`): {spy['busy_samples']:,} busy samples, "
        f"{spy['epoll_wait_samples']:,} more in the event loop's epoll wait (not counted "
        "below). Own samples by where the code lives, and the share of busy samples each "
        "layer is on the stack of:",
        "",
        *_md_table(
            ["area (own)", "%", "layer (on the stack)", "%"],
            [
                [
                    *(list(map(str, own)) if own else ["", ""]),
                    *(list(map(str, layer)) if layer else ["", ""]),
                ]
                for own, layer in _zip_longest(spy["own_by_area"][:10], spy["layers"])
            ],
            "lrlr",
        ),
        "",
        "Frames with the most samples of their own:",
        "",
        *_md_table(
            ["frame", "% own"],
            [[f"`{f.replace('|', '/')}`", str(p)] for f, p in spy["top_own"][:12]],
        ),
        "",
    ]


def _zip_longest(a: list[Any], b: list[Any]) -> list[tuple[Any, Any]]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else None, b[i] if i < len(b) else None) for i in range(n)]


def _profile_section(extra: dict[str, Any]) -> list[str]:
    out = ["## Where the time goes", ""]
    out += _spy("py-spy of server process 1 at the most clients, no prefix", extra.get("py_spy"))
    out += _spy("py-spy of server process 1 during DeleteTenant", extra.get("py_spy_offboarding"))
    phases = extra.get("rss_by_phase_mib")
    if phases:
        out += [
            f"**Server memory**: VmHWM at the end {extra.get('server_vmhwm_mib')} MiB; peak "
            "VmRSS by phase: " + ", ".join(f"{k} {v}" for k, v in phases.items()) + ".",
            "",
        ]
    return out


def write(path: Path, document: dict[str, Any]) -> None:
    path.write_text(markdown(document, _kept_analysis(path)))

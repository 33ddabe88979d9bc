"""The Grafana dashboard (dashboards/kvquota.json) asks only for metrics the service really
exports, and shows every family it exports: checked against a real server's exporter after a
small scenario that gives the labelled families samples."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.duration_pb2 import Duration
from prometheus_client.parser import text_string_to_metric_families

from kvquota.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc
from kvquota.v1 import resources_pb2 as pb
from quota_service.config import Settings
from quota_service.engine.simulated import EventPublisher
from tests.conftest import SWEEP_SECONDS
from tests.integration.grpc_helpers import admit, free_port, quota, refused
from tests.integration.scraping import body, samples_of, serving, until


@pytest.fixture(scope="module")
def settings(settings: Settings) -> Settings:
    """The server at work waits on its maintenance loop: every 0.2 s here."""
    return replace(settings, reaper_interval_seconds=SWEEP_SECONDS)


DASHBOARD = Path(__file__).parents[2] / "dashboards" / "kvquota.json"

# What a family's samples are called, by its type (the parser names counters without _total).
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("", "_count", "_sum"),
}
# Words of PromQL that are neither metrics nor functions (functions are followed by "(").
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
IDENTIFIER = re.compile(r"(?<![\w$.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
UNSAMPLED = {
    "kvquota_instance_engine_requests_running",
    "kvquota_instance_cpu_tier_used_bytes",
    "kvquota_instance_cpu_tier_capacity_bytes",
}
LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*\w+\s*\)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label
    matchers, ranges, grouping clauses, function calls, numbers and keywords are set aside."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = GROUPING.sub(" ", expr)
    return {
        m.group(1)
        for m in IDENTIFIER.finditer(expr)
        if m.group(2) is None and m.group(1).lower() not in KEYWORDS
    }


def test_the_expression_reader_finds_the_metrics_and_only_them() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, method) (rate(kvquota_rpc_duration_seconds_bucket"
        '{method!="Watch", code=~"OK|x"}[$__rate_interval]))) / ignoring(le) up > bool 0.5 '
        "and on (instance) time() - kvquota_a offset 5m"
    )
    assert metric_names(expr) == {"kvquota_rpc_duration_seconds_bucket", "up", "kvquota_a"}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found += panel.get("panels", [])  # a collapsed row holds its panels
    return found


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [
        target["expr"]
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def variable_metrics(dashboard: dict[str, Any]) -> set[str]:
    """The metrics the dashboard's query variables read their values from."""
    found = set()
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        matched = LABEL_VALUES.fullmatch(text.strip())
        assert matched, f"variable {variable['name']}: {text!r} is not label_values(metric, l)"
        found.add(matched.group(1))
    return found


def names(text: str) -> set[str]:
    return {name for name, _ in samples_of(text)}


def seconds(value: float) -> Duration:
    duration = Duration()
    duration.FromNanoseconds(int(value * 1e9))
    return duration


async def exported_by_a_server_at_work(database_url: str, settings: Settings) -> str:
    """The exporter's text after admissions (admitted, queued out, refused), a release, a
    reclaim job and engine events: every labelled family has samples."""
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    publisher = EventPublisher(events, replay)
    try:
        async with serving(settings, database_url) as (channel, url):
            admin = admin_pb2_grpc.AdminServiceStub(channel)
            gateway = admission_pb2_grpc.AdmissionServiceStub(channel)
            engine = pb.EngineEndpoints(
                url="http://127.0.0.1:1", kv_events_endpoint=events, kv_replay_endpoint=replay
            )
            await admin.RegisterInstance(
                admin_pb2.RegisterInstanceRequest(
                    instance_id="gpu-0",
                    block_size=16,
                    max_model_len=4096,
                    num_gpu_blocks=8,
                    geometry=pb.KvGeometry(
                        num_layers=2, num_kv_heads=2, head_dim=64, dtype=pb.KV_DTYPE_FP16
                    ),
                    engine=engine,
                )
            )
            await admin.CreateTenant(
                admin_pb2.CreateTenantRequest(tenant_id="acme", tenant=pb.Tenant(quota=quota()))
            )

            async def following() -> bool:
                # Every replica's maintenance loop follows new engines; live batches reach the
                # follower once it has subscribed. It starts the instance's cache from empty:
                # the cached blocks below come after that.
                removed: dict[str, object] = {"type": "BlockRemoved", "block_hashes": [7]}
                await publisher.publish([removed])
                return "kvquota_engine_event_lag_seconds_count" in names(await body(url))

            await until(following)
            await gateway.Admit(admit("cached", 32, 1, prompt_token_ids=list(range(32))))
            # 2 + 6 blocks (one output token never gets a slot): the instance is full.
            await gateway.Admit(admit("big", 6 * 16, 1))
            await refused(gateway.Admit(admit("late", 16, 1, wait_timeout=seconds(0.1))))
            await refused(gateway.Admit(admit("bad", 0, 1)))
            name = "tenants/acme/reservations/cached"
            await gateway.Release(admission_pb2.ReleaseRequest(name=name))
            await admin.CreateReclaimJob(
                admin_pb2.CreateReclaimJobRequest(
                    instance="instances/gpu-0",
                    target_blocks=2,
                    max_tier=pb.RECLAIM_TIER_FREE,
                    request_id="free-2",
                )
            )

            async def reclaimed() -> bool:  # by any replica's maintenance loop
                return "kvquota_reclaimed_blocks_total" in names(await body(url))

            await until(reclaimed)
            return await body(url)
    finally:
        publisher.close()


async def test_every_dashboard_expression_names_exported_metrics(
    database_url: str, settings: Settings
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = await exported_by_a_server_at_work(database_url, settings)
    families = {
        f.name: f.type
        for f in text_string_to_metric_families(exported)
        if f.name.startswith("kvquota_") and not f.name.endswith("_created")
    }
    sampled = names(exported)
    # Each family as PromQL names it, and the names of its samples.
    names_of = {
        family: {family + suffix for suffix in SUFFIXES.get(kind, ("",))}
        for family, kind in families.items()
    }
    selectable = set().union(*names_of.values())
    # The scenario gave every family samples (so their names are real ones), but for what it
    # has no source of: no engine load read, no CPU tier.
    empty = {f for f, names in names_of.items() if not names & sampled}
    assert empty == UNSAMPLED

    used: set[str] = set(variable_metrics(dashboard))
    for expr in expressions(dashboard):
        named = metric_names(expr)
        assert named, f"no metric in {expr!r}"
        assert named <= selectable, f"{expr!r} names {sorted(named - selectable)}"
        used |= named
    unshown = sorted(f for f, names in names_of.items() if not names & used)
    assert not unshown, f"families the dashboard never shows: {unshown}"


def test_the_dashboard_is_an_importable_grafana_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == (
        "datasource",
        "prometheus",
    )
    source = {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys()
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == source, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        assert all(t["datasource"] == source for t in panel["targets"]), panel["title"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == source

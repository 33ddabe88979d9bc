"""Settings: defaults, then an optional TOML file, then KVQUOTA_* environment variables.

`KVQUOTA_CONFIG` names the TOML file; its keys are the field names below (e.g. `grpc_listen`).
Every value is checked at start-up so a typo fails loudly instead of running with a default.
"""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

from quota_service.core.admission import AdmissionLimits
from quota_service.core.queueing import QueuePolicy
from quota_service.core.reclaim import DEFAULT_WATERMARKS, CpuWatermarks, Tier
from quota_service.event_loop import LOOPS
from quota_service.logs import FORMATS

ENV_PREFIX = "KVQUOTA_"


class SettingsError(ValueError):
    """A setting is missing, unknown or out of range; the message names it."""


@dataclass(frozen=True, slots=True)
class Settings:
    # Unset: an embedded PostgreSQL is started under data_dir (development only).
    database_url: str = ""
    data_dir: Path = Path(".kvquota")
    grpc_listen: str = "127.0.0.1:50051"
    # Prometheus /metrics ("host:port", port 0 picks one; empty: not served), and how old the
    # ledger snapshot behind it may get.
    metrics_listen: str = "127.0.0.1:9464"
    metrics_refresh_seconds: float = 5.0
    db_pool_size: int = 10
    default_lease_ttl_seconds: float = 60.0
    min_lease_ttl_seconds: float = 1.0
    max_lease_ttl_seconds: float = 3600.0
    max_n: int = 16
    min_retry_delay_seconds: float = 0.1
    max_retry_delay_seconds: float = 300.0
    reaper_interval_seconds: float = 1.0
    reaper_batch_size: int = 500
    # The wait queue: see core/queueing.py.
    max_bypass_wait_seconds: float = 5.0
    dispatch_batch: int = 32
    # Waiting callers re-read their reservation this often even without a notification.
    queue_poll_seconds: float = 1.0
    # Release follows the engine: each abort call's timeout, and how long a reservation keeps
    # its blocks while its engine cannot be reached before it is released anyway.
    engine_abort_timeout_seconds: float = 2.0
    engine_abort_hard_timeout_seconds: float = 30.0
    # The CPU tier (LMCache L1): reclaim offloads suspended sessions only while its use stays
    # at or below the low watermark, and would compress only above the high one.
    cpu_offload_watermark: float = DEFAULT_WATERMARKS.offload
    cpu_compress_watermark: float = DEFAULT_WATERMARKS.compress
    # The reclaim policy: the highest tier its jobs may use ("none" turns it off; "offload"
    # touches only idle sessions), the share of an instance in use above which it reclaims
    # while work waits, and how often at most it starts a job for one scope.
    reclaim_policy_max_tier: str = "offload"
    reclaim_policy_watermark: float = 0.95
    reclaim_policy_cooldown_seconds: float = 30.0
    # Usage: an hour is closed (and billed) this long after it ended, so that transactions
    # that started within it have committed their events.
    usage_close_grace_seconds: float = 300.0
    # A closed hour's events are kept this long (for audits), then purged; its hours stay.
    usage_event_retention_seconds: float = 7 * 86400.0
    # TLS for the gRPC server: a certificate chain and its key (PEM files; both or neither), and
    # for mutual TLS the CA whose client certificates are required.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    # Every RPC but health and reflection needs an API key (`kvquota keys`); turn it off only
    # for local development. Verified keys are cached this long, so a revocation takes effect
    # on every replica within it.
    auth_required: bool = True
    auth_cache_seconds: float = 5.0
    shutdown_grace_seconds: float = 10.0
    log_level: str = "INFO"
    # "json" (one object per line, with the request id) or "text".
    log_format: str = "json"
    # The server's event loop: "uvloop" or "asyncio" (quota_service/event_loop.py).
    event_loop: str = "uvloop"
    # Memory hot path: how long an instance's owner holds it without renewing (it renews every
    # third of that); another replica takes the instance over once the lease has lapsed.
    owner_lease_seconds: float = 5.0
    # Group commit: a replica whose last transaction carried at least
    # GROUP_COMMIT_BUSY_OPERATIONS operations (it is under load) holds its owners' next batches
    # open this long, to one moment for all, so that more operations share one commit
    # (journal.GroupCommit); 0 writes at once.
    group_commit_wait_seconds: float = 0.003
    group_commit_busy_operations: int = 4
    # Where the other replicas reach this one to forward calls for the instances it owns
    # (host:port); empty: the listen address, with this host's name for a wildcard host and the
    # bound port for port 0.
    advertise_address: str = ""
    # The CA that signed the other replicas' certificates, when they serve TLS (forwarded calls
    # present this replica's own certificate); empty: the client CA, else the system's roots.
    tls_peer_ca_file: str = ""

    def __post_init__(self) -> None:
        positive = (
            "db_pool_size",
            "default_lease_ttl_seconds",
            "min_lease_ttl_seconds",
            "max_n",
            "min_retry_delay_seconds",
            "reaper_interval_seconds",
            "reaper_batch_size",
            "dispatch_batch",
            "queue_poll_seconds",
            "engine_abort_timeout_seconds",
            "owner_lease_seconds",
            "group_commit_busy_operations",
            "engine_abort_hard_timeout_seconds",
            "metrics_refresh_seconds",
            "reclaim_policy_cooldown_seconds",
            "usage_close_grace_seconds",
            "usage_event_retention_seconds",
            "auth_cache_seconds",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise SettingsError(f"{ENV_PREFIX}{name.upper()} must be positive")
        if not (
            self.min_lease_ttl_seconds
            <= self.default_lease_ttl_seconds
            <= self.max_lease_ttl_seconds
        ):
            raise SettingsError(
                "lease TTLs must satisfy min_lease_ttl_seconds <= default_lease_ttl_seconds "
                "<= max_lease_ttl_seconds"
            )
        if self.min_retry_delay_seconds > self.max_retry_delay_seconds:
            raise SettingsError("min_retry_delay_seconds must not exceed max_retry_delay_seconds")
        if self.metrics_listen and not self.metrics_listen.rsplit(":", 1)[-1].isdigit():
            raise SettingsError(f"{ENV_PREFIX}METRICS_LISTEN must be host:port (or empty)")
        if not 0 < self.cpu_offload_watermark <= self.cpu_compress_watermark <= 1:
            raise SettingsError(
                "CPU-tier watermarks must satisfy 0 < cpu_offload_watermark <= "
                "cpu_compress_watermark <= 1"
            )
        # Policy jobs start at OFFLOAD (FREE makes no room for admission): FREE alone is none.
        policy_tiers = [t.name.lower() for t in Tier if t >= Tier.OFFLOAD]
        if self.reclaim_policy_max_tier not in ("none", *policy_tiers):
            raise SettingsError(
                f"{ENV_PREFIX}RECLAIM_POLICY_MAX_TIER must be none or one of "
                + ", ".join(policy_tiers)
            )
        if not 0 < self.reclaim_policy_watermark <= 1:
            raise SettingsError(f"{ENV_PREFIX}RECLAIM_POLICY_WATERMARK must be in (0, 1]")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise SettingsError(
                f"{ENV_PREFIX}TLS_CERT_FILE and {ENV_PREFIX}TLS_KEY_FILE go together"
            )
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise SettingsError(
                f"{ENV_PREFIX}TLS_CLIENT_CA_FILE (mutual TLS) needs the server's "
                f"{ENV_PREFIX}TLS_CERT_FILE and {ENV_PREFIX}TLS_KEY_FILE"
            )
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "tls_peer_ca_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise SettingsError(f"{ENV_PREFIX}{name.upper()}: no such file: {path}")
        if self.log_format not in FORMATS:
            raise SettingsError(f"{ENV_PREFIX}LOG_FORMAT must be one of " + ", ".join(FORMATS))
        if self.event_loop not in LOOPS:
            raise SettingsError(f"{ENV_PREFIX}EVENT_LOOP must be one of " + ", ".join(LOOPS))
        if self.log_level.upper() not in logging.getLevelNamesMapping():
            raise SettingsError(f"{ENV_PREFIX}LOG_LEVEL: unknown level {self.log_level!r}")
        for name in ("shutdown_grace_seconds", "group_commit_wait_seconds"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{ENV_PREFIX}{name.upper()} must not be negative")

    @property
    def queue_policy(self) -> QueuePolicy:
        return QueuePolicy(self.max_bypass_wait_seconds, self.dispatch_batch)

    @property
    def reclaim_policy_tier(self) -> Tier | None:
        """None: the policy starts no job."""
        if self.reclaim_policy_max_tier == "none":
            return None
        return Tier[self.reclaim_policy_max_tier.upper()]

    @property
    def cpu_watermarks(self) -> CpuWatermarks:
        return CpuWatermarks(self.cpu_offload_watermark, self.cpu_compress_watermark)

    @property
    def admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(
            max_n=self.max_n,
            default_lease_ttl_seconds=self.default_lease_ttl_seconds,
            min_lease_ttl_seconds=self.min_lease_ttl_seconds,
            max_lease_ttl_seconds=self.max_lease_ttl_seconds,
            min_retry_delay_seconds=self.min_retry_delay_seconds,
            max_retry_delay_seconds=self.max_retry_delay_seconds,
        )


_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _coerce(name: str, raw: object, kind: type) -> object:
    try:
        if kind is Path:
            return Path(str(raw))
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            return _BOOLEANS[str(raw).strip().lower()]
        if kind in (int, float) and isinstance(raw, bool):
            raise ValueError("a boolean is not a number")
        return kind(raw)
    except KeyError:
        raise SettingsError(f"{name}: cannot read {raw!r} as a boolean (true or false)") from None
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{name}: cannot read {raw!r} as {kind.__name__} ({exc})") from None


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    kinds = {
        f.name: {"str": str, "int": int, "float": float, "bool": bool, "Path": Path}[str(f.type)]
        for f in fields(Settings)
    }
    values: dict[str, object] = {}
    config_file = env.get(f"{ENV_PREFIX}CONFIG")
    if config_file:
        try:
            document = tomllib.loads(Path(config_file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"{ENV_PREFIX}CONFIG={config_file}: {exc}") from None
        for key, raw in document.items():
            if key not in kinds:
                raise SettingsError(f"{config_file}: unknown setting {key!r}")
            values[key] = _coerce(key, raw, kinds[key])
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX) or key == f"{ENV_PREFIX}CONFIG":
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name in kinds:
            values[name] = _coerce(key, raw, kinds[name])
    return replace(Settings(), **values)  # type: ignore[arg-type]

"""Settings from defaults, a TOML file and KVQUOTA_* variables, checked at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest

from quota_service.config import SettingsError, load_settings


def test_defaults() -> None:
    settings = load_settings({})
    assert settings.grpc_listen == "127.0.0.1:50051"
    assert settings.database_url == ""
    assert settings.default_lease_ttl_seconds == 60.0


def test_environment_overrides_file(tmp_path: Path) -> None:
    config = tmp_path / "kvquota.toml"
    config.write_text('grpc_listen = "0.0.0.0:6000"\nmax_n = 8\ndata_dir = "/srv/kvq"\n')
    settings = load_settings({"KVQUOTA_CONFIG": str(config), "KVQUOTA_MAX_N": "4"})
    assert (settings.grpc_listen, settings.max_n, settings.data_dir) == (
        "0.0.0.0:6000",
        4,
        Path("/srv/kvq"),
    )


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"KVQUOTA_MAX_N": "many"}, "KVQUOTA_MAX_N"),
        ({"KVQUOTA_DB_POOL_SIZE": "0"}, "DB_POOL_SIZE"),
        ({"KVQUOTA_DEFAULT_LEASE_TTL_SECONDS": "7200"}, "lease TTLs"),
        ({"KVQUOTA_CONFIG": "/nonexistent/kvquota.toml"}, "KVQUOTA_CONFIG"),
        ({"KVQUOTA_RECLAIM_POLICY_MAX_TIER": "free"}, "none or one of offload"),
        ({"KVQUOTA_RECLAIM_POLICY_WATERMARK": "1.5"}, "RECLAIM_POLICY_WATERMARK"),
        ({"KVQUOTA_CPU_OFFLOAD_WATERMARK": "0.95"}, "CPU-tier watermarks"),
        ({"KVQUOTA_AUTH_REQUIRED": "maybe"}, "KVQUOTA_AUTH_REQUIRED: cannot read 'maybe'"),
        ({"KVQUOTA_AUTH_CACHE_SECONDS": "0"}, "AUTH_CACHE_SECONDS"),
        ({"KVQUOTA_LOG_FORMAT": "xml"}, "LOG_FORMAT must be one of json, text"),
        ({"KVQUOTA_LOG_LEVEL": "LOUD"}, "LOG_LEVEL: unknown level"),
        ({"KVQUOTA_EVENT_LOOP": "trio"}, "EVENT_LOOP must be one of uvloop, asyncio"),
        ({"KVQUOTA_GROUP_COMMIT_WAIT_SECONDS": "-0.001"}, "WAIT_SECONDS must not be negative"),
        ({"KVQUOTA_GROUP_COMMIT_BUSY_OPERATIONS": "0"}, "BUSY_OPERATIONS must be positive"),
        ({"KVQUOTA_SHUTDOWN_GRACE_SECONDS": "-1"}, "SHUTDOWN_GRACE_SECONDS must not be negative"),
    ],
)
def test_bad_settings_say_which(environ: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(environ)


def test_unknown_key_in_file(tmp_path: Path) -> None:
    config = tmp_path / "kvquota.toml"
    config.write_text("grpc_lsten = 1\n")
    with pytest.raises(SettingsError, match="grpc_lsten"):
        load_settings({"KVQUOTA_CONFIG": str(config)})


def test_authentication_is_on_unless_turned_off(tmp_path: Path) -> None:
    assert load_settings({}).auth_required
    assert not load_settings({"KVQUOTA_AUTH_REQUIRED": "false"}).auth_required
    config = tmp_path / "kvquota.toml"
    config.write_text("auth_required = false\n")
    assert not load_settings({"KVQUOTA_CONFIG": str(config)}).auth_required

"""A gateway's configuration: one TOML file, named by `--config` or KVQUOTA_GATEWAY_CONFIG, and
the API key from KVQUOTA_API_KEY (a secret stays out of files that get committed).

    kvquota = ["kvquota-0:50051", "kvquota-1:50051"]
    wait_timeout_seconds = 2        # queue at most this long for capacity; 0 fails fast
    lease_ttl_seconds = 30          # renewed every third while the answer streams
    default_max_tokens = 256        # written into requests that name no limit

    [models.llama-3-8b]             # one table per model name the clients send
    tokenizer = "meta-llama/Meta-Llama-3-8B-Instruct"   # a directory or a hub id
    instance = "gpu-0"              # or engine_address = "http://10.0.0.5:8000"

    [envoy]
    listen = "127.0.0.1:50052"
    tenant_header = "x-kvquota-tenant"     # or tenant_metadata = "namespace:path.to.key"
    engine_header = "x-gateway-destination-endpoint"   # the endpoint picker's choice
    objective_header = "x-gateway-inference-objective"
    [envoy.objective_priorities]
    critical = 10
    sheddable = -10

    [litellm]
    tenant_from = "team"            # team, user or key_alias of the caller's virtual key

Every key is checked when the file is read, so a typo fails at start-up.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

CONFIG_ENV = "KVQUOTA_GATEWAY_CONFIG"
API_KEY_ENV = "KVQUOTA_API_KEY"
# Where the Gateway API Inference Extension's endpoint picker writes its choices.
INFERENCE_OBJECTIVE_HEADER = "x-gateway-inference-objective"
TENANT_SOURCES = ("team", "user", "key_alias")


class ConfigError(ValueError):
    """The configuration is missing, malformed, or names an unknown key; the message says which."""


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """Where requests for one model go, and how its prompts are tokenized."""

    tokenizer: str
    # The kvquota instance ("gpu-0"), or the engine's address, unless the gateway's endpoint
    # picker names the engine per request (envoy.engine_header).
    instance: str = ""
    engine_address: str = ""


@dataclass(frozen=True, slots=True)
class EnvoyConfig:
    listen: str = "127.0.0.1:50052"
    # The tenant: a request header the gateway's own authentication sets (never a client's raw
    # header: Envoy must overwrite or strip it), or "namespace:path.to.key" in the dynamic
    # metadata Envoy forwards (metadata_options.forwarding_namespaces). Exactly one of them.
    tenant_header: str = ""
    tenant_metadata: str = ""
    engine_header: str = ""
    objective_header: str = INFERENCE_OBJECTIVE_HEADER
    objective_priorities: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LitellmConfig:
    tenant_from: str = "team"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    kvquota: tuple[str, ...]
    models: Mapping[str, ModelRoute]
    api_key: str | None = None
    wait_timeout_seconds: float = 0.0
    lease_ttl_seconds: float = 30.0
    default_max_tokens: int = 256
    envoy: EnvoyConfig = EnvoyConfig()
    litellm: LitellmConfig = LitellmConfig()


def _table(document: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = document.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}{key} must be a table")
    return value


_KINDS: dict[str, type] = {"str": str, "int": int, "float": float}


def _fields(cls: type, document: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The document's keys, each one a field of the dataclass `cls`, of the field's kind."""
    kinds = {f.name: _KINDS.get(str(f.type)) for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, value in document.items():
        if key not in kinds:
            raise ConfigError(f"unknown setting {where}{key}")
        kind = kinds[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ConfigError(f"{where}{key} must be a {kind.__name__}, not {value!r}")
        values[key] = value
    return values


def parse(document: Mapping[str, Any], environ: Mapping[str, str]) -> GatewayConfig:
    top = {k: v for k, v in document.items() if k not in ("models", "envoy", "litellm")}
    if "api_key" in top:
        raise ConfigError(f"the API key comes from {API_KEY_ENV}, never from the file")
    addresses = top.pop("kvquota", None)
    if isinstance(addresses, str):
        addresses = [addresses]
    if not addresses or not all(isinstance(a, str) for a in addresses):
        raise ConfigError("kvquota must name the servers' addresses (host:port)")
    models: dict[str, ModelRoute] = {}
    for name, route in _table(document, "models", "").items():
        if not isinstance(route, Mapping):
            raise ConfigError(f"models.{name} must be a table")
        model = ModelRoute(**_fields(ModelRoute, route, f"models.{name}."))
        if model.instance and model.engine_address:
            raise ConfigError(f"models.{name}: name an instance or an engine_address, not both")
        models[name] = model
    if not models:
        raise ConfigError("no [models.NAME] table: the gateway must know how to tokenize")
    envoy_values = _fields(EnvoyConfig, _table(document, "envoy", ""), "envoy.")
    priorities = envoy_values.get("objective_priorities", {})
    if not all(isinstance(p, int) for p in priorities.values()):
        raise ConfigError("envoy.objective_priorities maps objective names to integers")
    envoy = EnvoyConfig(**envoy_values)
    if envoy.tenant_header and envoy.tenant_metadata:
        raise ConfigError("envoy: set tenant_header or tenant_metadata, not both")
    if envoy.tenant_metadata and ":" not in envoy.tenant_metadata:
        raise ConfigError("envoy.tenant_metadata is 'namespace:path.to.key'")
    litellm = LitellmConfig(**_fields(LitellmConfig, _table(document, "litellm", ""), "litellm."))
    if litellm.tenant_from not in TENANT_SOURCES:
        raise ConfigError(f"litellm.tenant_from is one of {', '.join(TENANT_SOURCES)}")
    config = GatewayConfig(
        kvquota=tuple(addresses),
        models=models,
        api_key=environ.get(API_KEY_ENV) or None,
        envoy=envoy,
        litellm=litellm,
        **_fields(GatewayConfig, top, ""),
    )
    if config.wait_timeout_seconds < 0 or config.lease_ttl_seconds <= 0:
        raise ConfigError("wait_timeout_seconds must be >= 0 and lease_ttl_seconds > 0")
    if config.default_max_tokens < 1:
        raise ConfigError("default_max_tokens must be at least 1")
    return config


def load(path: str | None = None, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """The configuration in `path`, else in the file KVQUOTA_GATEWAY_CONFIG names."""
    env = os.environ if environ is None else environ
    path = path or env.get(CONFIG_ENV)
    if not path:
        raise ConfigError(f"no configuration: pass --config or set {CONFIG_ENV}")
    try:
        document = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return parse(document, env)

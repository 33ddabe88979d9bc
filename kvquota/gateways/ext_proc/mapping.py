"""Who a request is for and where it goes, from what Envoy tells the external processor: its
request headers and the dynamic metadata of the namespaces it forwards. Only sources the
configuration names are read: a tenant never comes from a header a client could set unless the
operator says Envoy sets (or overwrites) that header itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvquota.gateways.config import EnvoyConfig
from kvquota.gateways.openai_requests import BadLlmRequest

REQUEST_ID_HEADER = "x-request-id"


class UnknownTenant(BadLlmRequest):
    """Neither the configured header nor the metadata names the tenant (answered 401)."""


def _metadata_value(metadata: Mapping[str, Any], source: str) -> object:
    """The value at "namespace:path.to.key" in the forwarded metadata, or None."""
    namespace, _, path = source.partition(":")
    value: object = metadata.get(namespace)
    for key in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def tenant(config: EnvoyConfig, headers: Mapping[str, str], metadata: Mapping[str, Any]) -> str:
    if config.tenant_header:
        value: object = headers.get(config.tenant_header)
        source = f"header {config.tenant_header}"
    else:
        value = _metadata_value(metadata, config.tenant_metadata)
        source = f"metadata {config.tenant_metadata}"
    if not isinstance(value, str) or not value:
        raise UnknownTenant(f"no tenant in {source}")
    return value


def priority(config: EnvoyConfig, headers: Mapping[str, str]) -> int:
    """The priority the configuration gives the request's inference objective (0 when it names
    none or one the configuration does not know)."""
    objective = headers.get(config.objective_header, "")
    return config.objective_priorities.get(objective, 0)


def engine_address(config: EnvoyConfig, headers: Mapping[str, str]) -> str:
    """The engine the endpoint picker chose, when the configuration reads it: the first of its
    candidates ("10.0.0.5:8000,10.0.0.6:8000" lists fallbacks)."""
    if not config.engine_header:
        return ""
    return headers.get(config.engine_header, "").split(",")[0].strip()

"""Resource names (AIP-122): `tenants/{tenant}`, `instances/{instance}`,
`tenants/{tenant}/reservations/{request_id}`."""

from __future__ import annotations

import re

from quota_service.core.errors import FieldViolation, invalid_request, quoted, refuse_invalid

# Ids become URL path segments and metric labels: lowercase, short, no separators.
RESOURCE_ID = re.compile(r"[a-z][a-z0-9-]{0,62}")
# Gateways use UUIDs or OpenAI-style ids ("chatcmpl-…"); "/" would break the reservation name.
REQUEST_ID = re.compile(r"[A-Za-z0-9._~:-]{1,128}")
API_KEY_ID = re.compile(r"[0-9a-f]{16}")


def _id_or_violation(value: str, pattern: re.Pattern[str], field: str) -> FieldViolation | None:
    if pattern.fullmatch(value):
        return None
    return FieldViolation(field, f"{quoted(value)} does not match {pattern.pattern}")


def check_resource_id(value: str, field: str) -> FieldViolation | None:
    return _id_or_violation(value, RESOURCE_ID, field)


def check_request_id(value: str, field: str) -> FieldViolation | None:
    return _id_or_violation(value, REQUEST_ID, field)


def parse_child(name: str, collection: str, field: str) -> tuple[str | None, FieldViolation | None]:
    """Split `{collection}/{id}` into its id, or say what is wrong with it."""
    prefix = f"{collection}/"
    if not name.startswith(prefix):
        return None, FieldViolation(
            field, f"must look like {collection}/{{id}}, got {quoted(name)}"
        )
    value = name[len(prefix) :]
    violation = check_resource_id(value, field)
    return (None, violation) if violation else (value, None)


def _child_id(name: str, collection: str, field: str) -> str:
    value, violation = parse_child(name, collection, field)
    if violation:
        raise invalid_request([violation])
    assert value is not None
    return value


def tenant_id(name: str, field: str = "name") -> str:
    return _child_id(name, "tenants", field)


def instance_id(name: str, field: str = "name") -> str:
    return _child_id(name, "instances", field)


def reclaim_job_id(name: str, field: str = "name") -> str:
    return _child_id(name, "reclaimJobs", field)


def parse_reservation(
    name: str, field: str = "name"
) -> tuple[tuple[str, str] | None, list[FieldViolation]]:
    """`tenants/{tenant}/reservations/{request_id}` → (tenant, request_id), or what is wrong."""
    parts = name.split("/")
    if len(parts) != 4 or parts[0] != "tenants" or parts[2] != "reservations":
        return None, [
            FieldViolation(
                field, f"must look like tenants/{{t}}/reservations/{{id}}: {quoted(name)}"
            )
        ]
    violations = [
        v
        for v in (check_resource_id(parts[1], field), check_request_id(parts[3], field))
        if v is not None
    ]
    return (None if violations else (parts[1], parts[3])), violations


def reservation_key(name: str, field: str = "name") -> tuple[str, str]:
    """`tenants/{tenant}/reservations/{request_id}` → (tenant, request_id), or INVALID_REQUEST."""
    key, violations = parse_reservation(name, field)
    refuse_invalid(violations)
    assert key is not None
    return key


def api_key_id(name: str, field: str = "name") -> str:
    """`apiKeys/{key_id}` → key_id (16 hex digits)."""
    value = name.removeprefix("apiKeys/")
    if value == name or not API_KEY_ID.fullmatch(value):
        raise invalid_request(
            [FieldViolation(field, f"must look like apiKeys/{{16 hex digits}}, got {quoted(name)}")]
        )
    return value


def tenant_name(tenant: str) -> str:
    return f"tenants/{tenant}"


def instance_name(instance: str) -> str:
    return f"instances/{instance}"


def namespace_name(namespace: str) -> str:
    return f"namespaces/{namespace}"


def reclaim_job_name(job_id: str) -> str:
    return f"reclaimJobs/{job_id}"


def reservation_name(tenant: str, request_id: str) -> str:
    return f"tenants/{tenant}/reservations/{request_id}"


OWNER_COLLECTIONS = ("tenants", "namespaces")


def owner_violation(name: str, field: str = "parent") -> FieldViolation | None:
    """None when `name` is `tenants/{t}` or `namespaces/{n}`."""
    collection = name.split("/", 1)[0]
    if collection not in OWNER_COLLECTIONS:
        return FieldViolation(
            field, f"must be tenants/{{t}} or namespaces/{{n}}, got {quoted(name)}"
        )
    return parse_child(name, collection, field)[1]


def owner(name: str, field: str = "parent") -> tuple[str, str]:
    """`tenants/{t}` or `namespaces/{n}` → (collection, id): who a pin or a salt belongs to."""
    violation = owner_violation(name, field)
    if violation:
        raise invalid_request([violation])
    collection, value = name.split("/", 1)
    return collection, value


def parse_pin(
    name: str, field: str = "name"
) -> tuple[tuple[str, str] | None, list[FieldViolation]]:
    """`{owner}/pins/{pin}` → (owner name, pin id), or what is wrong with its owner and its id."""
    parts = name.split("/")
    if len(parts) != 4 or parts[2] != "pins":
        return None, [
            FieldViolation(field, f"must look like {{owner}}/pins/{{id}}: {quoted(name)}")
        ]
    owner_name = "/".join(parts[:2])
    violations = [
        v
        for v in (owner_violation(owner_name, field), check_resource_id(parts[3], field))
        if v is not None
    ]
    return (None if violations else (owner_name, parts[3])), violations


def pin_key(name: str, field: str = "name") -> tuple[str, str]:
    """`{owner}/pins/{pin}` → (owner name, pin id), or INVALID_REQUEST."""
    key, violations = parse_pin(name, field)
    refuse_invalid(violations)
    assert key is not None
    return key


def parse_filter(
    name: str, collection: str, field: str
) -> tuple[str | None, FieldViolation | None]:
    """An optional `{collection}/{id}` filter: its id, None when not given, or what is wrong."""
    return parse_child(name, collection, field) if name else (None, None)


def namespace_id(name: str, field: str = "name") -> str:
    value, violation = parse_child(name, "namespaces", field)
    if violation:
        raise invalid_request([violation])
    assert value is not None
    return value

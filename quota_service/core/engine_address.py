"""An engine named by its network address, as an endpoint picker (Gateway API Inference
Extension, llm-d) hands it to a gateway: vLLM's base URL (`http://10.0.0.5:8000`) or `host:port`.

Both spellings, and the URL an instance was registered with, reduce to one key, `host:port`
with the host in lower case and the scheme's default port filled in, so that whichever one a
gateway has finds the instance. A path (`/v1`) says nothing about which engine it is.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from quota_service.core.errors import FieldViolation, quoted

DEFAULT_PORTS = {"http": 80, "https": 443}
# The registered engine URL's column holds at most this many characters.
MAX_ADDRESS = 200


def normalise(address: str) -> str | None:
    """`host:port` for a base URL or a `host:port`; None when it is neither."""
    given = address.strip()
    scheme = given.split("://", 1)[0].lower() if "://" in given else None
    if scheme is not None and scheme not in DEFAULT_PORTS:
        return None
    try:
        parts = urlsplit(given if scheme is not None else f"//{given}")
        port = parts.port
    except ValueError:  # a port that is not a number, or out of range
        return None
    if port is None and scheme is not None:
        port = DEFAULT_PORTS[scheme]
    host = parts.hostname
    if not host or port is None or parts.username is not None or len(given) > MAX_ADDRESS:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse(address: str, field: str) -> tuple[str | None, FieldViolation | None]:
    """The key of an address a caller gave, or what is wrong with it."""
    key = normalise(address)
    if key is None:
        given = quoted(address)
        return None, FieldViolation(field, f"must be an http(s) base URL or host:port, got {given}")
    return key, None

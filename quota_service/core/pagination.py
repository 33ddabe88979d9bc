"""Keyset pagination for every List (AIP-158): opaque tokens that carry the last id returned."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from quota_service.core.errors import FieldViolation, invalid_request

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
# Tokens this API issues carry one id: far shorter than this.
MAX_PAGE_TOKEN = 1024


@dataclass(frozen=True, slots=True)
class Page:
    size: int
    after: str | None


def page(page_size: int, page_token: str) -> Page:
    if page_size < 0:
        raise invalid_request([FieldViolation("page_size", "must not be negative")])
    size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    if not page_token:
        return Page(size, None)
    if len(page_token) > MAX_PAGE_TOKEN:
        raise invalid_request([FieldViolation("page_token", "not a token this API issued")])
    try:
        after = json.loads(base64.urlsafe_b64decode(page_token.encode()))["after"]
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeError):
        raise invalid_request(
            [FieldViolation("page_token", "not a token this API issued")]
        ) from None
    if not isinstance(after, str) or "\0" in after:
        raise invalid_request([FieldViolation("page_token", "not a token this API issued")])
    return Page(size, after)


def next_token(ids: list[str], size: int) -> str:
    """A token for the page after `ids`, or "" when this page was the last."""
    if len(ids) < size:
        return ""
    return base64.urlsafe_b64encode(json.dumps({"after": ids[-1]}).encode()).decode()

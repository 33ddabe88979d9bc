"""Keyset pagination for every List (AIP-158): opaque tokens that carry the last id returned."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from quota_service.core.errors import FieldViolation, refuse_invalid

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
# Tokens this API issues carry one id: far shorter than this.
MAX_PAGE_TOKEN = 1024


@dataclass(frozen=True, slots=True)
class Page:
    size: int
    after: str | None


def parse_page(
    page_size: int, page_token: str, numeric: bool = False
) -> tuple[Page | None, list[FieldViolation]]:
    """The page asked for, or what is wrong with its size and its token. `numeric`: the List
    keys its pages by a number (a block id, an event id), so a token must carry one."""
    violations = []
    if page_size < 0:
        violations.append(FieldViolation("page_size", "must not be negative"))
    after = _after(page_token) if page_token else None
    if page_token and (after is None or (numeric and not after.isdigit())):
        violations.append(FieldViolation("page_token", "not a token this API issued"))
    if violations:
        return None, violations
    return Page(min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE), after), []


def _after(page_token: str) -> str | None:
    """The id a token carries; None when it is not a token this API issued."""
    if len(page_token) > MAX_PAGE_TOKEN:
        return None
    try:
        after = json.loads(base64.urlsafe_b64decode(page_token.encode()))["after"]
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeError):
        return None
    if not isinstance(after, str) or "\0" in after:
        return None
    return after


def page(page_size: int, page_token: str) -> Page:
    """The page asked for, or INVALID_REQUEST naming what is wrong with it."""
    found, violations = parse_page(page_size, page_token)
    refuse_invalid(violations)
    assert found is not None
    return found


def next_token(ids: list[str], size: int) -> str:
    """A token for the page after `ids`, or "" when this page was the last."""
    if len(ids) < size:
        return ""
    return base64.urlsafe_b64encode(json.dumps({"after": ids[-1]}).encode()).decode()

"""Resource names and page tokens."""

from __future__ import annotations

import pytest

from quota_service.core import names, pagination
from quota_service.core.errors import KvQuotaError


def test_names_round_trip() -> None:
    assert names.tenant_id(names.tenant_name("acme")) == "acme"
    assert names.instance_id(names.instance_name("gpu-0")) == "gpu-0"
    assert names.reservation_key(names.reservation_name("acme", "chatcmpl-1.a:b~c")) == (
        "acme",
        "chatcmpl-1.a:b~c",
    )


@pytest.mark.parametrize(
    "name",
    ["acme", "tenant/acme", "tenants/Acme", "tenants/", "tenants/a/b", "tenants/" + "a" * 64],
)
def test_bad_tenant_names(name: str) -> None:
    with pytest.raises(KvQuotaError) as error:
        names.tenant_id(name)
    assert error.value.reason == "INVALID_REQUEST"


@pytest.mark.parametrize(
    "name",
    ["tenants/acme/reservations/", "tenants/acme/other/x", "tenants/acme/reservations/a b", "x"],
)
def test_bad_reservation_names(name: str) -> None:
    with pytest.raises(KvQuotaError):
        names.reservation_key(name)


def test_pages() -> None:
    assert pagination.page(0, "") == pagination.Page(pagination.DEFAULT_PAGE_SIZE, None)
    assert pagination.page(5000, "").size == pagination.MAX_PAGE_SIZE
    token = pagination.next_token(["a", "b"], 2)
    assert pagination.page(2, token) == pagination.Page(2, "b")
    assert pagination.next_token(["a"], 2) == ""
    for bad in ("nope", "e30=", "eyJhZnRlciI6IDF9"):  # garbage, {}, {"after": 1}
        with pytest.raises(KvQuotaError):
            pagination.page(2, bad)
    with pytest.raises(KvQuotaError):
        pagination.page(-1, "")


def test_a_page_is_refused_for_every_fault_at_once() -> None:
    page, violations = pagination.parse_page(-1, "nope")
    assert page is None
    assert [v.field for v in violations] == ["page_size", "page_token"]
    # Lists paged by number take only a token that carries one.
    named = pagination.next_token(["a"], 1)
    assert pagination.parse_page(1, named)[0] == pagination.Page(1, "a")
    assert [v.field for v in pagination.parse_page(1, named, numeric=True)[1]] == ["page_token"]
    numbered = pagination.next_token(["7"], 1)
    assert pagination.parse_page(1, numbered, numeric=True) == (pagination.Page(1, "7"), [])


def test_a_pin_name_is_refused_for_its_owner_and_its_id_at_once() -> None:
    key, violations = names.parse_pin("teams/acme/pins/Bad")
    assert key is None
    assert len(violations) == 2
    assert names.parse_pin("tenants/acme/pins/system") == (("tenants/acme", "system"), [])

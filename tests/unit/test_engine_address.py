"""Every spelling of one engine's address reduces to the same key; anything else is refused."""

from __future__ import annotations

import pytest

from quota_service.core import engine_address


@pytest.mark.parametrize(
    ("given", "key"),
    [
        ("http://10.0.0.5:8000", "10.0.0.5:8000"),
        ("http://10.0.0.5:8000/", "10.0.0.5:8000"),
        ("10.0.0.5:8000", "10.0.0.5:8000"),
        (" HTTP://Engine-0.Example:8000/v1 ", "engine-0.example:8000"),
        ("https://engine-0.example", "engine-0.example:443"),
        ("http://engine-0.example", "engine-0.example:80"),
        ("[fd00::5]:8000", "[fd00::5]:8000"),
        ("http://[FD00::5]:8000", "[fd00::5]:8000"),
    ],
)
def test_spellings_of_one_engine_share_a_key(given: str, key: str) -> None:
    assert engine_address.normalise(given) == key


@pytest.mark.parametrize(
    "given",
    ["", "engine-0", "engine-0:http", "engine-0:99999", "tcp://engine-0:5557", "http://u@e:1"],
)
def test_what_names_no_engine_is_refused(given: str) -> None:
    assert engine_address.normalise(given) is None
    key, violation = engine_address.parse(given, "engine_address")
    assert key is None
    assert violation is not None
    assert violation.field == "engine_address"

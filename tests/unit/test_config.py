"""``pskv.config.getenv``: every setting is read through it (docs/SPEC.md, "Settings")."""

from __future__ import annotations

import re

import pytest

from pskv import config
from pskv.errors import ConfigError


@pytest.mark.parametrize(("raw", "want"), [("1", True), (" Yes ", True), ("ON", True), ("true", True),
                                           ("0", False), ("off", False), ("No", False), ("FALSE", False), ("", False)])
def test_a_boolean_setting_takes_the_usual_words(monkeypatch: pytest.MonkeyPatch, raw: str, want: bool) -> None:
    monkeypatch.setenv("PSKV_ENCRYPT", raw)
    assert config.encrypt() is want


@pytest.mark.parametrize(("name", "raw", "said"), [
    ("PSKV_ENCRYPT", "maybe", "PSKV_ENCRYPT='maybe' is not a valid bool"),
    ("PSKV_MIN_WORKERS", "-1", "PSKV_MIN_WORKERS='-1' is not a valid int >= 0"),
    ("PSKV_MIN_WORKERS", "1.5", "PSKV_MIN_WORKERS='1.5' is not a valid int >= 0"),
    ("PSKV_TIMEOUT", "inf-ish", "PSKV_TIMEOUT='inf-ish' is not a valid float >= 0.01"),
])
def test_a_setting_that_does_not_parse_is_named(monkeypatch: pytest.MonkeyPatch, name: str, raw: str, said: str) -> None:
    monkeypatch.setenv(name, raw)
    reader = {"PSKV_ENCRYPT": config.encrypt, "PSKV_MIN_WORKERS": config.min_workers, "PSKV_TIMEOUT": config.timeout}[name]
    with pytest.raises(ConfigError, match=f"^environment variable {re.escape(said)}$"):
        reader()


def test_choices_are_read_in_lower_case_and_least_raises_a_small_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSKV_X", "Error")
    assert config.getenv("PSKV_X", "skip", choices=("skip", "error")) == "error"
    monkeypatch.setenv("PSKV_X", "ignore")
    with pytest.raises(ConfigError, match="PSKV_X='ignore' is not a valid str: one of skip, error"):
        config.getenv("PSKV_X", "skip", choices=("skip", "error"))
    monkeypatch.setenv("PSKV_X", "3")
    assert config.getenv("PSKV_X", 10, least=8) == 8

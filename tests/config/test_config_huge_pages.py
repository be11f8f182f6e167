"""daemon.huge_pages: auto by default, the three modes (YAML's bare `off`, a boolean, too),
and a clear error for anything else.
It is the daemon's own choice of memory, so it never changes what peers compare."""

from __future__ import annotations

import pytest

from kvxferd.config import load_config_text, resolve
from kvxferd.errors import ConfigError


def _daemon(body: str) -> str:
    return f"daemon:\n  {body}\n" if body else ""


def test_auto_is_the_default_and_every_mode_loads() -> None:
    assert load_config_text("", "d.yaml").daemon.huge_pages == "auto"
    for mode in ("auto", "off", "required", "'off'"):
        cfg = load_config_text(_daemon(f"huge_pages: {mode}"), "d.yaml")
        assert cfg.daemon.huge_pages == mode.strip("'")  # YAML's bare off (false) is off too


@pytest.mark.parametrize("value", ["always", "true", "on", "2", "''"])
def test_anything_else_is_an_error_naming_the_setting(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(_daemon(f"huge_pages: {value}"), "d.yaml")
    text = "\n".join(info.value.problems)
    assert "daemon.huge_pages" in text, text
    assert "must be one of 'auto', 'off', 'required'" in text, text


def test_it_does_not_change_the_fingerprint() -> None:
    plain = resolve(load_config_text("", "d.yaml")).fingerprint()
    for mode in ("off", "required"):
        cfg = load_config_text(_daemon(f"huge_pages: {mode}"), "d.yaml")
        assert resolve(cfg).fingerprint() == plain

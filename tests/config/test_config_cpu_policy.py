"""daemon.cpu_policy: auto by default, batch and inherit, and a clear error for anything else. It is
the daemon's own scheduling, so it never changes what peers compare."""

from __future__ import annotations

import pytest

from kvxferd.config import load_config_text, resolve
from kvxferd.errors import ConfigError


def test_auto_is_the_default_and_the_others_load() -> None:
    assert load_config_text("", "d.yaml").daemon.cpu_policy == "auto"
    for choice in ("batch", "inherit"):
        cfg = load_config_text(f"daemon:\n  cpu_policy: {choice}\n", "d.yaml")
        assert cfg.daemon.cpu_policy == choice


@pytest.mark.parametrize("value", ["fifo", "other", "BATCH", "AUTO", "true", "''"])
def test_anything_else_is_an_error_naming_the_setting(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(f"daemon:\n  cpu_policy: {value}\n", "d.yaml")
    text = "\n".join(info.value.problems)
    assert "daemon.cpu_policy" in text, text
    assert "must be one of 'auto', 'batch', 'inherit'" in text, text


def test_it_does_not_change_the_fingerprint() -> None:
    plain = resolve(load_config_text("", "d.yaml")).fingerprint()
    cfg = load_config_text("daemon:\n  cpu_policy: inherit\n", "d.yaml")
    assert resolve(cfg).fingerprint() == plain


def test_a_reload_that_changes_it_says_a_restart_is_needed_and_keeps_it() -> None:
    # The policy is applied once, before the daemon's threads start; a SIGHUP cannot move
    # them all again safely, so it is reported like every other start-up setting.
    from kvxferd.service.reload import plan

    base = "engine: {role: context}\n"
    old = load_config_text(base, "old.yaml")
    new = load_config_text(base + "daemon: {cpu_policy: inherit}\n", "new.yaml")
    cfg, _settings, report = plan(old, resolve(old), None, new, resolve(new), None)
    assert [c.split(":")[0] for c in report.restart_needed] == ["daemon.cpu_policy"]
    assert cfg.daemon.cpu_policy == "auto"  # the running value is kept

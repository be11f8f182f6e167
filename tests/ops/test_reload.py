"""SIGHUP reload: a valid file's live values are applied (and used by new
requests), what needs a restart is reported and kept, an invalid file changes
nothing; plus the reload plan's rules, in-process."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest
import yaml
from daemon_harness import SimEngine, status, wait_for
from ops_harness import http_get, parse, scrape, value

from kvxferd.config import load_config_text, resolve
from kvxferd.service.reload import plan, startup_problems
from kvxferd.sim.cluster import DaemonProc, LocalCluster


def _rewrite(d: DaemonProc, update: dict[str, dict[str, Any]]) -> None:
    doc = yaml.safe_load(d.config_path.read_text())
    for section, values in update.items():
        doc[section].update(values)
    d.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))


def _reload_and_wait(d: DaemonProc, count: int) -> dict[str, Any]:
    """SIGHUP, then the status once the `count`-th reload has been reported."""
    d.proc.send_signal(signal.SIGHUP)
    wait_for(
        lambda: (
            value(parse(scrape(d)), "kvxferd_config_reloads_total", result="applied")
            + value(parse(scrape(d)), "kvxferd_config_reloads_total", result="unchanged")
            + value(parse(scrape(d)), "kvxferd_config_reloads_total", result="rejected")
            >= count
        ),
        20,
        f"reload #{count}",
    )
    return status(d)


def test_sighup_applies_live_changes_and_reports_what_needs_a_restart(
    cluster: LocalCluster,
) -> None:
    ctx = cluster.start_daemon("ctx", "context", transceiver={"kv_transfer_timeout_ms": 20000})
    before = status(ctx)
    assert before["settings"]["kv_transfer_timeout_ms"] == 20000
    _rewrite(
        ctx,
        {
            "cache_transceiver_config": {
                "kv_transfer_timeout_ms": 800,
                "kv_transfer_poll_interval_ms": 250,
                "max_tokens_in_buffer": 512,
            },
            "daemon": {"log_level": "DEBUG", "drain_timeout_ms": 4000},
            "engine": {"tensor_parallel_size": 2},  # needs a restart
        },
    )
    after = _reload_and_wait(ctx, 1)
    settings = after["settings"]
    assert settings["kv_transfer_timeout_ms"] == 800
    assert settings["kv_transfer_poll_interval_ms"] == 250
    assert settings["admission_window_blocks"] == 16
    assert after["admission"]["window_blocks"] == 16
    assert after["fingerprint"] == before["fingerprint"]  # nothing peers compare changed
    assert after["incarnation"] == before["incarnation"] and after["pid"] == before["pid"]
    last = after["config"]["last_reload"]
    assert last["result"] == "applied"
    assert any(
        c.startswith("cache_transceiver_config.kv_transfer_timeout_ms") for c in last["applied"]
    )
    assert any(c.startswith("daemon.log_level") for c in last["applied"])
    assert [c.split(":")[0] for c in last["restart_needed"]] == ["engine.tensor_parallel_size"]
    text = ctx.log_text()
    assert (
        "WARNING kvxferd.reload: reload: engine.tensor_parallel_size: 1 -> 2 needs a restart"
        in (text)
    )

    # New requests get the new deadline: a send nobody receives times out after ~0.8 s.
    async def lonely_send() -> float:
        c = await SimEngine.open(ctx)
        try:
            await c.send("lonely", 32)
            out = await c.client.wait("lonely", 30)
            assert (out.status, out.reason) == ("timed_out", "sender_deadline"), out
            return out.elapsed_ms
        finally:
            await c.close()

    elapsed_ms = asyncio.run(lonely_send())
    assert 700 <= elapsed_ms < 5000, elapsed_ms
    # The new log level is live: the next reload logs its DEBUG line.
    again = _reload_and_wait(ctx, 2)["config"]["last_reload"]
    assert again["result"] == "unchanged" and len(again["restart_needed"]) == 1
    assert " DEBUG kvxferd.reload: " in ctx.log_text()[len(text) :]
    assert ctx.stop() == 0


def test_sighup_with_a_bad_file_keeps_the_running_configuration(cluster: LocalCluster) -> None:
    ctx = cluster.start_daemon("ctx", "context", transceiver={"kv_transfer_timeout_ms": 20000})
    good = ctx.config_path.read_text()
    before = status(ctx)

    # 1. A value the schema refuses.
    ctx.config_path.write_text(
        good.replace("kv_transfer_timeout_ms: 20000", "kv_transfer_timeout_ms: -5")
    )
    after = _reload_and_wait(ctx, 1)
    assert after["settings"] == before["settings"]
    last = after["config"]["last_reload"]
    assert last["result"] == "rejected"
    assert "cache_transceiver_config.kv_transfer_timeout_ms" in last["problems"][0]
    assert "reload of" in ctx.log_text() and "rejected" in ctx.log_text()
    assert "cache_transceiver_config.kv_transfer_timeout_ms" in ctx.log_text()

    # 2. A file that loads but would not start (resolution error: PYTHON needs NIXL).
    ctx.config_path.write_text(good.replace("backend: NIXL", "backend: UCX"))
    after = _reload_and_wait(ctx, 2)
    assert after["settings"] == before["settings"]
    assert after["config"]["last_reload"]["result"] == "rejected"
    assert "UCX" in after["config"]["last_reload"]["problems"][0]

    # 3. Not YAML at all, then a file that is gone.
    ctx.config_path.write_text("cache_transceiver_config: [unclosed\n")
    assert _reload_and_wait(ctx, 3)["config"]["last_reload"]["result"] == "rejected"
    ctx.config_path.unlink()
    after = _reload_and_wait(ctx, 4)
    assert after["config"]["last_reload"]["result"] == "rejected"
    assert after["settings"] == before["settings"]

    # Through all of it the daemon kept serving.
    assert ctx.alive()
    assert http_get(ctx, "/readyz")[0] == 200
    assert value(parse(scrape(ctx)), "kvxferd_config_reloads_total", result="rejected") == 4
    assert "Traceback" not in ctx.log_text()

    # The original file back: a reload with nothing to change.
    ctx.config_path.write_text(good)
    assert _reload_and_wait(ctx, 5)["config"]["last_reload"]["result"] == "unchanged"
    assert ctx.stop() == 0


# ------------------------------------------------------------ the plan, in-process

BASE = """
cache_transceiver_config: {backend: NIXL, transceiver_runtime: auto, kv_transfer_timeout_ms: 20000}
engine: {role: context}
daemon: {name: ctx, peers: {gen0: "127.0.0.1:5000"}}
"""


def _plan(new_text: str) -> tuple[Any, Any, Any]:
    old = load_config_text(BASE, "old.yaml")
    new = load_config_text(new_text, "new.yaml")
    return plan(old, resolve(old), None, new, resolve(new), None)


def test_plan_applies_live_fields_and_keeps_the_rest() -> None:
    text = BASE.replace("kv_transfer_timeout_ms: 20000", "kv_transfer_timeout_ms: 5000").replace(
        "name: ctx", "name: ctx2, heartbeat_interval_ms: 300, heartbeat_timeout_ms: 900"
    )
    cfg, settings, report = _plan(text.replace('5000"', '5001"'))
    assert settings.kv_transfer_timeout_ms == 5000
    assert cfg.daemon.heartbeat_timeout_ms == 900 and cfg.daemon.heartbeat_interval_ms == 300
    assert cfg.daemon.peers == {"gen0": "127.0.0.1:5001"}
    assert cfg.daemon.name == "ctx"  # needs a restart: kept
    assert [c.split(":")[0] for c in report.restart_needed] == ["daemon.name"]
    assert report.result == "applied"


def test_plan_null_timeout_would_change_the_runtime_so_it_needs_a_restart() -> None:
    _cfg, settings, report = _plan(
        BASE.replace("kv_transfer_timeout_ms: 20000", "kv_transfer_timeout_ms: null")
    )
    assert settings.kv_transfer_timeout_ms == 20000  # kept
    assert settings.runtime == "PYTHON"
    needed = [c.split(":")[0] for c in report.restart_needed]
    assert "cache_transceiver_config.kv_transfer_timeout_ms" in needed
    assert "runtime (resolved)" in needed
    # ... which a restarted daemon could run: the staged runtime takes a null timeout.
    new = load_config_text(
        BASE.replace("kv_transfer_timeout_ms: 20000", "kv_transfer_timeout_ms: null"), "x"
    )
    assert resolve(new).runtime == "CPP"
    assert startup_problems(new, resolve(new)) == []


def test_startup_problems_name_a_backend_this_build_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxferd.backends import registry

    monkeypatch.delitem(registry.ONE_SIDED, "NIXL")
    cfg = load_config_text(BASE, "x")
    problems = startup_problems(cfg, resolve(cfg))
    assert len(problems) == 1 and "backend NIXL is not available in this build" in problems[0]


def test_plan_of_the_same_file_changes_nothing() -> None:
    _cfg, _settings, report = _plan(BASE)
    assert (report.result, report.applied, report.restart_needed) == ("unchanged", [], [])

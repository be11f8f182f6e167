"""A transport stall that outlasts daemon.stall_unhealthy_s makes the daemon unhealthy:
/healthz 503 naming the peers, the systemd watchdog pings stop (so the supervisor restarts
it), /v1/status says why. Over MPI a receive queue held up by a process killed inside a
shared-memory send never recovers without a new process (docs/backends-mpi.md); the real
stall is produced with a debugger by benchmarks/mpi_shm_stall.py, and a real MPI pair
reports it in tests/backends/test_mpi.py, so here the stalled peers are given."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any, cast

import pytest
from ops_harness import NotifyListener

from kvxferd.config import load_config_text, resolve
from kvxferd.errors import ConfigError
from kvxferd.service.daemon import Daemon
from kvxferd.service.http import HttpServer
from kvxferd.service.sdnotify import Notifier
from kvxferd.service.status import stall_health_problem


def test_only_peers_stalled_for_the_limit_make_it_unhealthy() -> None:
    assert stall_health_problem({}, 60) is None
    assert stall_health_problem({"ctx/1": 59.9}, 60) is None
    problem = stall_health_problem({"ctx-b/2": 75, "ctx-a/1": 61, "ctx-c/3": 7}, 60)
    assert problem is not None
    lines = problem.splitlines()
    assert [line.split()[4] for line in lines] == ["'ctx-a/1'", "'ctx-b/2'"]
    assert "for 61s although it is alive" in lines[0] and "a restart clears it" in lines[0]
    assert "daemon.stall_unhealthy_s 60" in lines[0]


def test_zero_turns_it_off() -> None:
    assert stall_health_problem({"ctx/1": 3600}, 0) is None


def _daemon(stalled: dict[str, float], limit_s: float) -> Any:
    cfg = SimpleNamespace(daemon=SimpleNamespace(stall_unhealthy_s=limit_s))
    # The stalled peers as the transport says them now (the dict may change under it).
    return SimpleNamespace(cfg=cfg, stalled_peers=lambda: dict(stalled), _unhealthy=False)


def test_the_daemon_logs_each_change_once(caplog: pytest.LogCaptureFixture) -> None:
    stalled: dict[str, float] = {"ctx/1": 90}
    d = _daemon(stalled, 60)
    with caplog.at_level(logging.WARNING, logger="kvxferd"):
        for _ in range(3):
            assert Daemon.health_problem(d) is not None
        stalled.clear()
        for _ in range(3):
            assert Daemon.health_problem(d) is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(errors) == 1 and "unhealthy (/healthz 503)" in errors[0].getMessage()
    assert "'ctx/1'" in errors[0].getMessage()
    assert len(warnings) == 1 and "healthy again" in warnings[0].getMessage()


def test_healthz_answers_503_with_the_lines_and_200_otherwise() -> None:
    problem: list[str | None] = ["transport: nothing from peer 'ctx/1' for 70s ..."]
    source = SimpleNamespace(
        ready=False,
        status=dict,
        readiness_detail=lambda: "",
        health_problem=lambda: problem[0],
    )
    server = HttpServer(cast(Any, source))
    code, _ctype, body = server.route("/healthz")
    assert code == 503 and body == b"unhealthy\ntransport: nothing from peer 'ctx/1' for 70s ...\n"
    problem[0] = None
    assert server.route("/healthz") == (200, "text/plain", b"ok\n")


def test_the_watchdog_pings_only_while_healthy() -> None:
    listener = NotifyListener()
    try:
        n = Notifier(env={"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": "40000"})
        healthy = [False]

        async def run() -> list[int]:
            task = asyncio.create_task(n.watchdog_loop(lambda: healthy[0]))
            counts = []
            for state in (False, True):
                healthy[0] = state
                await asyncio.sleep(0.3)  # 15 periods of 20 ms
                counts.append(len([m for m in listener.drain_for(0.05) if m.has("WATCHDOG")]))
            task.cancel()
            return counts

        unhealthy_pings, healthy_pings = asyncio.run(run())
        assert unhealthy_pings == 0
        assert healthy_pings >= 3
    finally:
        listener.close()


def test_the_setting_defaults_to_a_minute_and_refuses_negatives() -> None:
    assert load_config_text("", "d.yaml").daemon.stall_unhealthy_s == 60.0
    assert (
        load_config_text("daemon: {stall_unhealthy_s: 0}\n", "d.yaml").daemon.stall_unhealthy_s == 0
    )
    with pytest.raises(ConfigError) as info:
        load_config_text("daemon:\n  stall_unhealthy_s: -1\n", "d.yaml")
    text = "\n".join(info.value.problems)
    assert "daemon.stall_unhealthy_s" in text, text


def test_a_reload_applies_it_live() -> None:
    from kvxferd.service.reload import plan

    base = "engine: {role: context}\n"
    old = load_config_text(base, "old.yaml")
    new = load_config_text(base + "daemon: {stall_unhealthy_s: 300}\n", "new.yaml")
    cfg, _settings, report = plan(old, resolve(old), None, new, resolve(new), None)
    assert report.restart_needed == []
    assert cfg.daemon.stall_unhealthy_s == 300

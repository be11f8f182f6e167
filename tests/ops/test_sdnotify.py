"""sd_notify: the message sequence a service manager sees from a real daemon,
the watchdog pings, and the notifier's own rules (no-op without NOTIFY_SOCKET,
abstract sockets, WATCHDOG_PID)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from daemon_harness import start_on_a_busy_peer_port
from ops_harness import NotifyListener, http_get

from kvxferd.service.sdnotify import Notifier, monotonic_usec
from kvxferd.sim.cluster import LocalCluster


def test_ready_reload_and_stopping_come_in_order_from_the_daemons_pid(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    listener = NotifyListener(abstract=True)
    monkeypatch.setenv("NOTIFY_SOCKET", listener.address)
    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    try:
        d = cluster.start_daemon("ctx", "context", wait=False)
        ready = listener.wait_for(lambda n: n.has("READY"), 60, "READY=1")
        # READY=1 means ready: every listener is up and /readyz already says so.
        cluster.wait_ready(d, 5)
        assert http_get(d, "/readyz")[0] == 200
        before_ready = listener.received[: listener.received.index(ready)]
        assert any(n.fields.get("STATUS") == "starting" for n in before_ready)
        assert "ready" in ready.fields["STATUS"]

        # Watchdog: WATCHDOG_USEC=400 ms, so a ping every 200 ms.
        pings = [n for n in listener.drain_for(1.0) if n.has("WATCHDOG")]
        assert len(pings) >= 3, pings

        # SIGHUP: RELOADING=1 with the monotonic time of the reload, then READY=1.
        t0 = monotonic_usec()
        d.proc.send_signal(signal.SIGHUP)
        reloading = listener.wait_for(lambda n: n.has("RELOADING"), 30, "RELOADING=1")
        t1 = monotonic_usec()
        assert t0 <= int(reloading.fields["MONOTONIC_USEC"]) <= t1
        again = listener.wait_for(lambda n: n.has("READY"), 30, "READY=1 after the reload")
        assert again.fields["STATUS"].startswith("reload unchanged")

        # SIGTERM: STOPPING=1, then a clean exit.
        d.proc.send_signal(signal.SIGTERM)
        stopping = listener.wait_for(lambda n: n.has("STOPPING"), 30, "STOPPING=1")
        assert stopping.fields["STATUS"].startswith("draining")
        assert d.proc.wait(30) == 0

        sequence = [k for n in listener.received for k in n.fields if k != "WATCHDOG"]
        for earlier, later in (("READY", "RELOADING"), ("RELOADING", "STOPPING")):
            assert sequence.index(earlier) < sequence.index(later), sequence
        assert {n.pid for n in listener.received} == {d.proc.pid}
    finally:
        listener.close()


def test_no_ready_when_start_up_fails(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    listener = NotifyListener()
    monkeypatch.setenv("NOTIFY_SOCKET", listener.address)
    try:
        start_on_a_busy_peer_port(cluster)
        listener.drain_for(0.2)
        assert listener.received, "the daemon said nothing (not even STATUS=starting)"
        assert not any(n.has("READY") for n in listener.received), listener.received
    finally:
        listener.close()


# ------------------------------------------------------------------ the notifier


def test_without_notify_socket_everything_is_a_no_op() -> None:
    n = Notifier(env={})
    assert not n.enabled
    assert n.notify("READY=1") is False
    n.ready("x")
    n.stopping()
    asyncio.run(asyncio.wait_for(n.watchdog_loop(), 1))  # returns at once


def test_path_and_abstract_sockets_both_receive() -> None:
    for abstract in (False, True):
        listener = NotifyListener(abstract=abstract)
        try:
            n = Notifier(env={"NOTIFY_SOCKET": listener.address})
            n.reloading()
            got = listener.wait_for(lambda m: m.has("RELOADING"), 5)
            assert got.pid == __import__("os").getpid()
            assert int(got.fields["MONOTONIC_USEC"]) <= monotonic_usec()
            assert got.fields["STATUS"] == "reloading"
            n.close()
        finally:
            listener.close()


def test_watchdog_interval_honours_watchdog_pid() -> None:
    import os

    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000"}
    assert Notifier(env=env).watchdog_s == 30.0
    assert Notifier(env={**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_s == 30.0
    assert Notifier(env={**env, "WATCHDOG_PID": "1"}).watchdog_s is None
    assert Notifier(env={**env, "WATCHDOG_USEC": "0"}).watchdog_s is None
    assert Notifier(env={**env, "WATCHDOG_USEC": "soon"}).watchdog_s is None


def test_watchdog_loop_pings_every_half_interval() -> None:
    listener = NotifyListener()
    try:
        n = Notifier(env={"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": "100000"})

        async def run_for(seconds: float) -> None:
            task = asyncio.create_task(n.watchdog_loop())
            await asyncio.sleep(seconds)
            task.cancel()

        start = time.monotonic()
        asyncio.run(run_for(0.5))
        pings = [m for m in listener.drain_for(0.1) if m.has("WATCHDOG")]
        # 50 ms period over 0.5 s: about 10 (scheduling may cost one or two).
        assert 7 <= len(pings) <= 12, (len(pings), time.monotonic() - start)
    finally:
        listener.close()


def test_a_dead_manager_socket_is_reported_once_and_never_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    n = Notifier(env={"NOTIFY_SOCKET": "/nonexistent/kvxferd-notify.sock"})
    assert n.enabled
    for _ in range(5):
        assert n.notify("WATCHDOG=1") is False
    assert sum("sd_notify" in r.getMessage() for r in caplog.records) == 1

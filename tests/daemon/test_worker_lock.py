"""UCX's worker lock is a mutex wherever the daemon's own threads copy beside NIXL's writes
(the staged runtime, the PYTHON runtime's bounce buffer), and UCX's spinlock where writes go
straight out of the engine's blocks (service/daemon.py; docs/operations.md, "Listeners")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvxferd.backends.nixl import UCX_MUTEX_ENV
from kvxferd.sim.cluster import LocalCluster


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


@pytest.mark.parametrize(
    "transceiver, said",
    [
        ({"transceiver_runtime": "PYTHON"}, None),
        ({"transceiver_runtime": "PYTHON", "kv_cache_bounce_size_mb": 8}, "bounce buffer"),
        ({"transceiver_runtime": "CPP"}, "staged runtime"),
    ],
)
def test_the_worker_lock_follows_where_the_daemon_copies(
    cluster: LocalCluster,
    monkeypatch: pytest.MonkeyPatch,
    transceiver: dict[str, Any],
    said: str | None,
) -> None:
    monkeypatch.delenv(UCX_MUTEX_ENV, raising=False)
    d = cluster.start_daemon("ctx", "context", transceiver=transceiver)
    # Set with putenv before UCX starts, so /proc's copy of the starting environment does
    # not show it; the daemon's log says it.
    log = d.log_text()
    if said is None:
        assert "UCX_USE_MT_MUTEX" not in log
    else:
        assert f"{said} over NIXL: UCX_USE_MT_MUTEX=y" in log
    assert d.stop() == 0


def test_an_operators_choice_stands(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UCX_MUTEX_ENV, "n")
    bounce = {"transceiver_runtime": "PYTHON", "kv_cache_bounce_size_mb": 8}
    d = cluster.start_daemon("ctx", "context", transceiver=bounce)
    assert _environ(d.proc.pid)[UCX_MUTEX_ENV] == "n"
    assert "UCX_USE_MT_MUTEX" not in d.log_text()
    assert d.stop() == 0

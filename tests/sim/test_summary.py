"""The demo/bench summary joins both engines' records; a failure says what the daemon said."""

from __future__ import annotations

from typing import Any

from kvxferd.sim.cluster import summarise


def _rec(rid: str, status: str, reason: str = "ok", message: str = "", **kw: Any) -> dict[str, Any]:
    return {
        "request_id": rid,
        "status": status,
        "reason": reason,
        "message": message,
        "t_start_ns": 1_000_000,
        "t_end_ns": 3_000_000,
        "nbytes": 100,
        **kw,
    }


def test_the_first_failure_carries_the_daemons_message() -> None:
    ctx = {"records": [_rec("a", "done"), _rec("b", "done"), _rec("c", "failed", "peer_lost")]}
    gen = {
        "records": [
            _rec("a", "done", verified=True),
            _rec("b", "failed", "peer_refused", "tensor-parallel sizes differ (ctx 2, gen 1)"),
            _rec("c", "failed", "peer_lost", "peer ctx0 closed"),
        ]
    }
    s = summarise(ctx, gen)
    assert (s["requests"], s["verified"], s["failed"]) == (3, 1, 2)
    assert s["failures"] == {"peer_refused": 1, "peer_lost": 1}
    assert s["first_failure"] == "b: peer_refused: tensor-parallel sizes differ (ctx 2, gen 1)"


def test_no_failure_no_message() -> None:
    ctx = {"records": [_rec("a", "done")]}
    gen = {"records": [_rec("a", "done", verified=True)]}
    assert summarise(ctx, gen)["first_failure"] == ""

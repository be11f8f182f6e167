"""How discovery's state reads in `kvxferd status` and in the /readyz body."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from kvxferd.commands.status_cmd import discovery_line
from kvxferd.discovery import DiscoveryState
from kvxferd.service.status import readiness_detail


def _daemon(state: DiscoveryState, stalled: dict[str, float] | None = None) -> Any:
    return cast(
        Any,
        SimpleNamespace(
            discovery=SimpleNamespace(state=state), stalled_peers=lambda: dict(stalled or {})
        ),
    )


def test_readiness_detail_says_up_down_or_static() -> None:
    assert readiness_detail(_daemon(DiscoveryState("static"))) == "discovery: static\n"
    state = DiscoveryState("etcd", up=True, members=3)
    assert readiness_detail(_daemon(state)).startswith("discovery: up since ")
    assert state.mark(False, "etcd range at 10.0.0.1:2379: UNAVAILABLE")
    text = readiness_detail(_daemon(state))
    assert text.startswith("discovery: down since ") and "UNAVAILABLE" in text


def test_readiness_detail_names_stalled_peers_first() -> None:
    text = readiness_detail(_daemon(DiscoveryState("static"), {"ctx-b/2": 7.4, "ctx-a/1": 12}))
    assert text.splitlines() == [
        "transport: nothing from peer 'ctx-a/1' for 12s although it is alive",
        "transport: nothing from peer 'ctx-b/2' for 7s although it is alive",
        "discovery: static",
    ]


def test_status_line_names_the_error_only_when_down() -> None:
    state = DiscoveryState("etcd", up=True, members=4, registered=True)
    line = discovery_line(state.to_json_dict())
    assert "etcd up for" in line and "4 member(s), registered" in line and "error" not in line
    state.mark(False, "lease keepalive timed out")
    line = discovery_line(state.to_json_dict())
    assert "etcd DOWN for" in line and "last error: lease keepalive timed out" in line
    static = discovery_line(DiscoveryState("static", members=2).to_json_dict())
    assert static == "  discovery: static, 2 configured peer(s)"

"""A two-sided transport's failed first contact names UCX_NET_DEVICES when the operator
limited UCX to some devices: an address none of them reaches fails as "unreachable"
(seen: UCX_NET_DEVICES=eth0 with peers on loopback)."""

from __future__ import annotations

import pytest

from kvxferd.backends.twosided import connect_failures
from kvxferd.errors import PeerLostError


def _failed_connect() -> str:
    with pytest.raises(PeerLostError) as err, connect_failures("UCX", "gen/1", "127.0.0.1:9", 1.0):
        raise OSError("Destination is unreachable")
    return str(err.value)


def test_a_device_limit_is_named_in_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "eth0")
    message = _failed_connect()
    assert "gen/1 at 127.0.0.1:9" in message and "is the peer running?" in message
    assert "UCX_NET_DEVICES=eth0 here" in message, message


@pytest.mark.parametrize("devices", [None, "", "all"])
def test_no_device_limit_no_hint(monkeypatch: pytest.MonkeyPatch, devices: str | None) -> None:
    if devices is None:
        monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    else:
        monkeypatch.setenv("UCX_NET_DEVICES", devices)
    assert _failed_connect().endswith("is the peer running?")

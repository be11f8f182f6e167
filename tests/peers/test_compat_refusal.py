"""The settings refusal names what differs, including a setting only the peer announces
(kv_memory appears in a vram daemon's compat fields only, so a host daemon must still say
which setting it is instead of "fingerprints differ")."""

from __future__ import annotations

import textwrap

from kvxferd.config import ResolvedSettings, load_config_text, resolve
from kvxferd.peers.compat import check_peer
from kvxferd.peers.handshake import PeerIdentity
from kvxferd.peers.messages import Info


def _settings(engine: str = "") -> ResolvedSettings:
    text = "cache_transceiver_config:\n  backend: NIXL\n  transceiver_runtime: CPP\n"
    if engine:
        text += "engine:\n" + textwrap.indent(textwrap.dedent(engine).strip(), "  ") + "\n"
    return resolve(load_config_text(text, "d.yaml"))


def _info(settings: ResolvedSettings, compat: dict[str, object] | None = None) -> Info:
    return Info(
        agent_name="peer",
        agent_metadata=b"",
        pools=[],
        fingerprint=settings.fingerprint(),
        compat=settings.peer_compat_fields() if compat is None else compat,
        transceiver={},
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        context_parallel_size=1,
    )


PEER = PeerIdentity("gen", "inc-1", "generation")


def test_a_setting_only_the_peer_announces_is_named() -> None:
    host = _settings()
    vram = _settings("kv_memory: vram")
    refused = check_peer("context", host, [], PEER, _info(vram))
    assert refused is not None
    reason, message = refused
    assert reason == "settings"
    assert "kv_memory: ours None, peer vram" in message
    assert "fingerprints differ" not in message


def test_our_settings_are_named_as_before() -> None:
    host = _settings()
    vram = _settings("kv_memory: vram")
    refused = check_peer("generation", vram, [], PeerIdentity("ctx", "i", "context"), _info(host))
    assert refused is not None
    assert "kv_memory: ours vram, peer None" in refused[1]


def test_a_hostile_peer_cannot_flood_the_refusal() -> None:
    host = _settings()
    compat: dict[str, object] = {f"k{i}\n": "x" * 10_000 for i in range(100)}
    info = _info(host, compat)
    info = Info(
        **{**{f: getattr(info, f) for f in info.__struct_fields__}, "fingerprint": "0" * 16}
    )
    refused = check_peer("context", host, [], PEER, info)
    assert refused is not None
    message = refused[1]
    # Our three settings and at most four of the peer's own, each value cut short.
    assert message.count(": ours ") == 3 + 4
    assert len(message) < 2_000
    assert "\n" not in message.replace("\\n", "")

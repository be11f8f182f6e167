"""Hostile identities in the handshake (issue 14: logs must not trust peer strings).

A Hello whose name holds a newline would forge a whole log line; one with a 4 MiB name
wrote 4 MiB of log per attempt. Both are refused before the name reaches any log line or
message, the daemon answers nothing (no Challenge: no metadata of ours), counts the failed
handshakes, and the real peer is served throughout.
"""

from __future__ import annotations

import asyncio
import contextlib

from daemon_harness import peer_names, serve_once, status, until
from test_faults import _cfg, _closed_by_daemon

from kvxferd import PROTOCOL_VERSION
from kvxferd.peers.messages import PEER_CODEC, Hello
from kvxferd.sim.cluster import LocalCluster

FORGED = "2026-12-01 00:00:00 ERROR kvxferd.daemon forged line"


def test_bad_identities_are_refused_before_they_reach_a_log(cluster: LocalCluster) -> None:
    ctx = cluster.start_daemon("ctx", "context", **_cfg(10000))
    gen = cluster.start_daemon("gen", "generation", **_cfg(10000))
    host, port = ctx.peer_address.rsplit(":", 1)

    async def hello(name: str, incarnation: str = "1", role: str = "generation") -> list[object]:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            # A frame over the pre-authentication limit (the 4 MiB name) is refused on its
            # length prefix, unread: the daemon's close can reset our write of the rest.
            with contextlib.suppress(ConnectionError):
                writer.write(
                    PEER_CODEC.encode(
                        Hello(
                            version=PROTOCOL_VERSION,
                            name=name,
                            incarnation=incarnation,
                            role=role,
                            nonce=b"\0" * 32,
                        )
                    )
                )
                await writer.drain()
            return await _closed_by_daemon(reader, PEER_CODEC)
        finally:
            writer.close()

    async def scenario() -> None:
        await serve_once(ctx, gen, "before")
        before = sum(status(ctx)["handshake_failures"].values())
        log_before = len(ctx.log_text())
        bad = [
            (f"gen\n{FORGED}", "1", "generation"),
            ("x" * (4 << 20), "1", "generation"),
            ("gen", "1\nforged", "generation"),
            ("gen", "1", "generation\r\nforged"),
        ]
        for name, incarnation, role in bad:
            assert await hello(name, incarnation, role) == []  # closed, nothing sent back
        await until(
            lambda: sum(status(ctx)["handshake_failures"].values()) == before + len(bad),
            what="the refused handshakes counted",
        )
        text = ctx.log_text()
        assert not any(line.startswith(FORGED) for line in text.splitlines()), text[-2000:]
        assert "forged\n" not in text[log_before:] and "\nforged" not in text[log_before:]
        # Four refusals, each one bounded line: nowhere near the 4 MiB name.
        assert len(text) - log_before < 16_384, len(text) - log_before
        assert "bad identity" in text[log_before:]
        assert peer_names(ctx) == ["gen"]
        await serve_once(ctx, gen, "after")

    asyncio.run(scenario())

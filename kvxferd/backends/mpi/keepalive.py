"""Whether MPI still delivers from each live peer: a keepalive on both paths of a link.

Why: UCX's shared-memory transports give each process one receive queue that every
sender on the host writes into in order. A peer stopped or killed inside a send (between
claiming a slot and marking it written) holds that queue up: nothing from any peer of
the host arrives over MPI any more, until it resumes or, killed, for the life of the
receiving process (docs/backends-mpi.md, benchmarks/mpi_shm_stall.py). The peer channel
and each link's TCP connection go on working, so nothing else notices: every staged
receive just times out, and the daemon looked healthy.

How: every KEEPALIVE_S each side writes one ALIVE byte on the link's TCP connection and
sends a header-only MPI message (wire.keepalive_header) on the link's header tag, unless its
previous one has not left yet. The other side notes when each last came (housekeeping.py
reads headers; link.py reads the connection). A link whose TCP keepalives keep coming while
no MPI message has for STALL_S is *stalled*: its peer runs (a stopped or dead peer sends
neither), and what it sends over MPI does not reach us. The daemon reports stalled peers in
its status, its metrics and /readyz (not ready while any is), and logs each stall once,
with the way out; a stall ends by itself when MPI delivers again.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvxferd.backends.mpi import wire
from kvxferd.backends.mpi.link_state import Link, Peer
from kvxferd.service.logs import shown

log = logging.getLogger("kvxferd.backends.mpi")

# How often each side sends its keepalives, on each path of every live link.
KEEPALIVE_S = 1.0
# A link whose MPI has been silent this long while its TCP keepalives came is stalled.
STALL_S = 5.0
# TCP keepalives count as coming while the last is at most this old (a few missed sends
# of a busy peer are not its absence).
TCP_FRESH_S = 3 * KEEPALIVE_S
# ALIVE bytes a peer may send beyond two a KEEPALIVE_S since the link was made.
ALIVE_SLACK = 16


def send_keepalives(link: Link, MPI: Any, now: float) -> None:
    """Both keepalives of `link`, when due. An MPI one whose predecessor has not left (a
    receiver that does not take them, or a full queue) is skipped, not queued behind it.

    MPI ones only once the peer's first TCP keepalive came, which it sends only for a link
    it registered: a listener whose link the connecting side refused after the key check
    (identity.py) would otherwise send over an intercommunicator the other side freed, and
    MPICH gives a freed one's context to the next: the keepalive then arrived in place of
    the key on the connecting side's next link, which was refused for it (seen in
    tests/backends/test_mpi.py, the look-alike test)."""
    if link.lost is not None or link.given_up or now - link.keepalive_sent < KEEPALIVE_S:
        return
    link.keepalive_sent = now
    try:
        link.writer.write(wire.ALIVE)
    except Exception:  # its end is gone: the watcher says so
        return
    if not link.peer_registered:
        return
    req = link.keepalive_req
    try:
        if req is not None and not req.Test():
            return
        link.keepalive_req = link.comm.Isend([link.keepalive_buf, MPI.BYTE], 0, wire.HEADER_TAG)
    except Exception as exc:  # the link's MPI failed: reading its headers says so too
        log.debug("MPI: keepalive to a peer not sent: %s", exc)
        link.keepalive_req = None


def heard_tcp(link: Link, now: float, count: int = 1) -> bool:
    """`count` ALIVE bytes came: the peer runs. A gap longer than TCP_FRESH_S (it was
    stopped) starts a new run of them. False, and nothing noted, when the peer has sent
    more of them than a kvxferd peer could since the link was made (one a KEEPALIVE_S, with
    room to spare): a flood is not a keepalive."""
    first = not link.peer_registered
    link.alive_bytes += count
    if link.alive_bytes > ALIVE_SLACK + 2 * (now - link.made) / KEEPALIVE_S:
        return False
    if first or now - link.tcp_heard > TCP_FRESH_S:
        link.tcp_run_since = now
    link.tcp_heard = now
    return True


def check_stall(peer: Peer, link: Link, now: float) -> None:
    """Mark `link` stalled or not, logging each change once. Stalled: no MPI message for
    STALL_S while TCP keepalives came without a gap all that time (a peer that was
    stopped sends both again when it resumes, and the TCP one is read first)."""
    if link.lost is not None:
        link.stalled_since = None
        return
    silent = now - link.mpi_heard
    stalled = (
        link.peer_registered
        and silent >= STALL_S
        and now - link.tcp_heard <= TCP_FRESH_S
        and now - link.tcp_run_since >= STALL_S
    )
    if stalled and link.stalled_since is None:
        link.stalled_since = link.mpi_heard
        log.error(
            "MPI: nothing from %s has arrived over MPI for %.0fs although it is alive (its "
            "TCP keepalives come): this daemon's MPI receive queue is probably held by a "
            "process on this host that was stopped or killed inside a shared-memory send, "
            "and every staged MPI receive will time out until it resumes, or, killed, "
            "until this daemon restarts. /readyz reports not ready meanwhile. "
            "UCX_TLS=^sm with UCX_NET_DEVICES avoids it (docs/backends-mpi.md)",
            shown(peer.key),
            silent,
        )
    elif not stalled and link.stalled_since is not None and silent < STALL_S:
        log.warning(
            "MPI: messages from %s arrive again after %.0fs",
            shown(peer.key),
            now - link.stalled_since,
        )
        link.stalled_since = None


def stalled_peers(peers: dict[str, Peer], now: float | None = None) -> dict[str, float]:
    """Peer key -> seconds since its MPI was last heard, for each peer with a stalled link."""
    now = time.monotonic() if now is None else now
    out: dict[str, float] = {}
    for key, peer in peers.items():
        for link in peer.links:
            if link.lost is None and link.stalled_since is not None:
                out[key] = max(out.get(key, 0.0), now - link.stalled_since)
    return out

"""PeerShare: a generation daemon's share of the context daemon's table before the engine
sends, and the notes of sessions that moved on dropped at most once a second per peer."""

from __future__ import annotations

from kvxferd.transceiver.sessions import TxSession
from kvxferd.transceiver.tx_peer_share import PeerShare


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _made(share: PeerShare, sessions: dict[str, TxSession], peer: str, rid: str) -> TxSession:
    s = TxSession(request_id=rid, engine=None)
    sessions[rid] = s
    share.note(peer, s)
    return s


def test_a_peer_gets_half_and_others_their_own_half() -> None:
    sessions: dict[str, TxSession] = {}
    share = PeerShare(sessions, Clock())
    assert PeerShare.share(8) == 4 and PeerShare.share(1) == 1 and PeerShare.share(0) == 0
    for i in range(4):
        assert share.room("gen-a", 8)
        _made(share, sessions, "gen-a", f"a{i}")
    assert not share.room("gen-a", 8) and share.kept_by("gen-a") == 4
    assert share.room("gen-b", 8)  # another daemon's share is its own
    assert share.room("gen-a", 0)  # no limit: no share


def test_ended_or_sent_sessions_leave_the_share_at_the_next_prune() -> None:
    sessions: dict[str, TxSession] = {}
    clock = Clock()
    share = PeerShare(sessions, clock)
    made = [_made(share, sessions, "gen-a", f"a{i}") for i in range(4)]
    assert not share.room("gen-a", 8)  # pruned now: all four still waiting
    del sessions["a0"]  # ended (the receiver cancelled)
    made[1].engine = object()  # type: ignore[assignment]  # our engine sent it
    sessions["a2"] = TxSession(request_id="a2", engine=None)  # the id reused since
    # Within a second of the last prune the notes stand, however often it is asked.
    assert not share.room("gen-a", 8)
    clock.now += 1.0
    assert share.room("gen-a", 8) and share.kept_by("gen-a") == 1


def test_a_forgotten_session_leaves_the_notes_and_no_memory_behind() -> None:
    """Noted by a weak reference: the notes hold no session alive (before, a share of
    32,768 would have kept that many ended sessions, ~3 KiB each, until a prune)."""
    import gc

    sessions: dict[str, TxSession] = {}
    share = PeerShare(sessions, Clock())
    for i in range(3):
        _made(share, sessions, "gen-a", f"a{i}")
    del sessions["a1"]
    gc.collect()
    assert share.kept_by("gen-a") == 2


def test_a_session_our_engine_sends_leaves_its_peers_share_at_once() -> None:
    """No prune needed (and none due within the second): the peer may ask again."""
    sessions: dict[str, TxSession] = {}
    share = PeerShare(sessions, Clock())
    made = [_made(share, sessions, "gen-a", f"a{i}") for i in range(4)]
    assert not share.room("gen-a", 8)
    share.sent(made[0])
    assert share.room("gen-a", 8) and share.kept_by("gen-a") == 3
    share.sent(TxSession(request_id="a1", engine=None))  # another session of that id
    assert share.kept_by("gen-a") == 3

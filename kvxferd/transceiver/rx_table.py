"""The generation side's receives, by identity: (context peer, request id).

Request ids are unique per context instance only (docs/engine-integration.md, "Request
identity"), so two context instances may both send "r1" to a generation daemon that
serves both. A receive is therefore known by the context peer it names *as the engine
named it* (a daemon name or HOST:PORT, the string of Recv.peer, or the first of
Recv.peers for a head-merge) together with its request id. Two receives of one id must
name disjoint sets of context daemons: a context daemon keys its sends by request id
alone, so it could not tell two receives of one id apart.

The engine may leave the peer out of cancel, release and query (old engines do): that is
fine while the id is unambiguous, and refused (`ambiguous_request`, naming the candidates)
when two receives share it. Peer messages are matched by (connection, request id,
receive token): only a connection that is one of the receive's legs reaches it.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

from kvxferd.errors import RequestError
from kvxferd.peers.channel import PeerConnection
from kvxferd.transceiver.sessions import RxKey, RxSession

AMBIGUOUS_REQUEST = "ambiguous_request"


class RxTable(MutableMapping[RxKey, RxSession]):
    """The receives by (peer, request id), with an index by request id (every lookup of a
    peer message or an engine call without a peer starts from the id)."""

    def __init__(self) -> None:
        self._by_key: dict[RxKey, RxSession] = {}
        self._by_id: dict[str, dict[RxKey, RxSession]] = {}

    # -------------------------------------------------------- the mapping

    def __getitem__(self, key: RxKey) -> RxSession:
        return self._by_key[key]

    def __setitem__(self, key: RxKey, s: RxSession) -> None:
        if key != s.key:
            raise ValueError(f"receive {s.key} stored under {key}")
        self._by_key[key] = s
        self._by_id.setdefault(s.request_id, {})[key] = s

    def __delitem__(self, key: RxKey) -> None:
        s = self._by_key.pop(key)
        same = self._by_id[s.request_id]
        del same[key]
        if not same:
            del self._by_id[s.request_id]

    def __iter__(self) -> Iterator[RxKey]:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, s: RxSession) -> None:
        self[s.key] = s

    # ------------------------------------------------------------ lookups

    def of_id(self, request_id: str) -> list[RxSession]:
        """Every receive of this id (one per context instance)."""
        return list(self._by_id.get(request_id, {}).values())

    def clash(self, request_id: str, peers: list[str]) -> RxSession | None:
        """A receive of this id that names one of `peers` (as named) already."""
        wanted = set(peers)
        for s in self._by_id.get(request_id, {}).values():
            if wanted.intersection(leg.peer_address for leg in s.legs):
                return s
        return None

    def same_daemon(self, s: RxSession) -> tuple[RxSession, str] | None:
        """Another receive of s's id connected to a context daemon s is connected to (the
        engine named it another way: by name once, by address once): that one and the
        daemon's name."""
        mine = {leg.conn.peer.name for leg in s.legs if leg.conn is not None}
        for other in self._by_id.get(s.request_id, {}).values():
            if other is s:
                continue
            for leg in other.legs:
                if leg.conn is not None and leg.conn.peer.name in mine:
                    return other, leg.conn.peer.name
        return None

    def find(self, request_id: str, peer: str = "") -> RxSession | None:
        """The receive an engine call means. `peer` "" (an older engine): the only receive
        of the id, or RequestError `ambiguous_request` naming the candidates. Else the one
        whose context peers include `peer` as named, or as the daemon name its connection
        authenticated (an engine may name a daemon by address in recv and by name later)."""
        same = self._by_id.get(request_id)
        if not same:
            return None
        if not peer:
            if len(same) == 1:
                return next(iter(same.values()))
            raise RequestError(
                AMBIGUOUS_REQUEST,
                f"request {request_id!r} names {len(same)} receives, from the context peers "
                f"{', '.join(repr(s.peer) for s in same.values())}; "
                "say which: give the call's peer",
            )
        for s in same.values():
            if any(leg.peer_address == peer for leg in s.legs):
                return s
        for s in same.values():
            if any(leg.conn is not None and leg.conn.peer.name == peer for leg in s.legs):
                return s
        return None

    def match(self, conn: PeerConnection, request_id: str, rx_token: int) -> RxSession | None:
        """The receive a peer message is for: of this id, this token, and with `conn` as
        one of its legs. Anything else (late, foreign, another context instance's id) is
        None and never revives or touches a receive."""
        for s in self._by_id.get(request_id, {}).values():
            if s.rx_token == rx_token and s.leg_of(conn) is not None:
                return s
        return None

    def token_taken(self, request_id: str, rx_token: int) -> bool:
        return any(s.rx_token == rx_token for s in self._by_id.get(request_id, {}).values())

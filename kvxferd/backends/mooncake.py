"""MOONCAKE adapter for the staged (CPP) runtime: the only module that imports mooncake.

One Mooncake transfer engine per daemon, over TCP, with P2PHANDSHAKE metadata
(no etcd or other metadata server): each engine listens on an RPC port and
serves its own segment descriptor from there; a peer is named by its session
id "host:rpc_port". The engine is one-sided: a write goes into memory the
peer registered with its engine, so this adapter implements `Backend` like
the NIXL one.

What a daemon tells its peers about its engine, and the strict decoding of what they
tell it, is kvxferd/backends/mooncake_meta.py; Mooncake's own timeouts, set from
kv_transfer_timeout_ms, kvxferd/backends/mooncake_timeouts.py.

`add_peer` fetches the peer's segment descriptor from its RPC port once,
while the peer is demonstrably alive (it is answering our handshake), and
Mooncake caches it. Without this the first write would fetch it, on the
data-plane thread, and a stopped peer would hold that fetch (and every other
transfer of the daemon) for about a minute: Mooncake's handshake read has no
shorter deadline.

Writes
------
Each (local, remote) segment pair is one `transfer_submit_write` (it returns
at once) and is polled with `transfer_check_status`, so the data-plane thread
never waits for a transfer. The batch ids these return are pointers: Mooncake
frees a batch the moment `transfer_check_status` reports it finished (1) or
failed (-1), so a finished id is never touched again.
(`batch_transfer_async_write` is no use here: its only status call,
`get_batch_transfer_status`, blocks until the whole batch ends.)

Completion means "applied at the destination": Mooncake 0.3.13's TCP
transport speaks its acknowledged protocol (v2) to peers that advertise it,
and the peer sends the acknowledgement only after the last chunk was written
into the destination memory. Under the legacy framing a write "completes"
when its last byte leaves our socket buffer, so MC_TCP_PROTO=1 (which forces
it) is refused at start-up, and a peer running another Mooncake version is
refused in `add_peer`: the acknowledged protocol is vouched for on the
version this was verified with, on both sides.

Failures arrive only as -1, without a reason (the reason goes to Mooncake's
log on stderr). A failed write is classified by opening a TCP connection to
the peer's RPC port: refused, unreachable or silent past `probe_timeout_s`
means the peer is gone (PeerLostError, about 1 ms after a kill); otherwise it
is alive and refused the write or stopped making progress (TransferError).

Release, and what can still land
--------------------------------
Mooncake cannot cancel a write. `release` therefore refuses (raises
TransferError) while any segment of the handle is still in flight; the caller
retries, as the Backend contract requires, and the handle is marked released
only once Mooncake has reported every segment finished or failed. From then
on Mooncake neither reads the local source nor sends another byte of it: its
client session for the write has ended, and on failure it closed the
connection. A write that never finishes ends by Mooncake's own timeouts
(mooncake_timeouts.py), so a release is refused for at most about that long.

One thing no initiator can prevent: when the write failed because the PEER
was stopped (SIGSTOP, a hung host), the bytes already delivered into the
peer's kernel socket buffer (about 4 MiB on loopback, measured) are still
applied to the peer's memory when it resumes. A killed peer applies nothing
(its memory is gone), and a completed write has nothing left in flight.

Limits
------
* The engine's RPC and data listeners bind every interface and authenticate
  nothing: anyone who can reach those ports can write into registered memory.
  Use it on a trusted network (or firewall the ports); the host given to the
  engine is only the address peers are told to use.
* A peer that restarts on the same RPC port (Mooncake picks ports at random
  in a range of about 2000) keeps its stale cached descriptor here: writes to
  it fail until this daemon restarts. Mooncake's Python API cannot evict it.
* IPv4 addresses and host names only: a session id has no room for an IPv6
  literal.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxferd.backends.base import HOST, Memory, Segments, XferHandle, XferStatus, host_only
from kvxferd.backends.mooncake_meta import (
    PeerMetadata,
    check_host,
    decode_metadata,
    encode_metadata,
    split_session,
)
from kvxferd.backends.mooncake_timeouts import apply_timeouts
from kvxferd.errors import BackendUnavailableError, PeerLostError, StartupError, TransferError
from kvxferd.service.logs import shown

log = logging.getLogger("kvxferd.backends.mooncake")

PACKAGE = "mooncake-transfer-engine-non-cuda"
SYSTEM_LIBRARIES = "libibverbs1 librdmacm1 libnuma1 liburing2 libnl-3-200 libnl-route-3-200"

# transfer_check_status's answers.
_MC_DONE, _MC_IN_PROGRESS, _MC_FAILED, _MC_TIMED_OUT = 1, 0, -1, -2


def _load() -> Any:
    # Mooncake logs every connection at INFO level to stderr; warnings and
    # errors (a failed write's cause) are what an operator needs. Read when
    # the engine starts; an operator's own setting wins.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:
        if getattr(exc, "name", None) in ("mooncake", "mooncake.engine") and "No module" in str(
            exc
        ):
            what = f"backend MOONCAKE needs the {PACKAGE} package, which is not installed"
        else:
            what = f"backend MOONCAKE's engine ({PACKAGE}) does not load"
        hint = (
            f"; install it with `pip install {PACKAGE}` (scripts/install.sh does this) and "
            f"Debian's {SYSTEM_LIBRARIES} (scripts/system-deps.sh installs them)"
        )
        if "libcuda" in str(exc):
            hint += (
                "; the CUDA build (mooncake-transfer-engine) needs a GPU driver: on hosts "
                f"without one, uninstall it and install {PACKAGE}"
            )
        raise BackendUnavailableError(f"{what} ({exc}){hint}") from exc


def engine_version() -> str:
    """The installed Mooncake engine's package version ("unknown" if neither build is)."""
    for dist in (PACKAGE, "mooncake-transfer-engine"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _inside(regions: tuple[tuple[int, int], ...], address: int, nbytes: int) -> bool:
    return any(start <= address and address + nbytes <= start + length for start, length in regions)


@dataclass(frozen=True)
class _Registration:
    address: int
    nbytes: int


@dataclass
class _Peer:
    meta: PeerMetadata


@dataclass
class _Write:
    """The native handle: the batch ids (pointers) Mooncake has not finished yet."""

    peer: str
    session: str
    pending: list[int]
    failed: int = 0
    timed_out: bool = False
    error: TransferError | None = None
    extra: list[str] = field(default_factory=list)


class MooncakeBackend:
    """One Mooncake transfer engine (TCP, P2PHANDSHAKE), host (DRAM) memory."""

    name = "MOONCAKE"

    def __init__(
        self,
        agent_name: str,
        host: str = "127.0.0.1",
        transfer_timeout_ms: int | None = None,
        probe_timeout_s: float = 1.0,
    ) -> None:
        self.agent_name = agent_name
        self.host = check_host(host)
        self.probe_timeout_s = probe_timeout_s
        if os.environ.get("MC_TCP_PROTO", "").strip() == "1":
            raise StartupError(
                "MOONCAKE: MC_TCP_PROTO=1 forces Mooncake's legacy, unacknowledged TCP framing, "
                "under which a completed write may not have reached the peer's memory yet; "
                "unset it"
            )
        mc = _load()
        self.engine_version = engine_version()
        # Before the engine exists: Mooncake reads MC_TRANSFER_TIMEOUT when it is built.
        self.write_timeout_s = apply_timeouts(transfer_timeout_ms)
        try:
            self._engine: Any = mc.TransferEngine()
            rc = self._engine.initialize(self.host, "P2PHANDSHAKE", "tcp", "")
        except Exception as exc:
            raise StartupError(f"MOONCAKE transfer engine could not start: {exc}") from exc
        if rc != 0:
            raise StartupError(
                f"MOONCAKE transfer engine could not start on {self.host} (initialize returned "
                f"{rc}; Mooncake's log on stderr says why)"
            )
        self.session = f"{self.host}:{self._engine.get_rpc_port()}"
        self._regions: dict[int, int] = {}  # address -> nbytes, what we registered
        self._peers: dict[str, _Peer] = {}
        log.info(
            "MOONCAKE engine %s up (agent %s); a stuck write fails after %d s",
            self.session,
            agent_name,
            self.write_timeout_s,
        )

    # ------------------------------------------------------------ memory

    def register(self, address: int, nbytes: int, memory: Memory = HOST) -> object:
        # Mooncake's TCP transport reads and writes registered memory from the host CPU.
        refused = host_only(self.name, memory)
        if refused is not None:
            raise StartupError(refused)
        if nbytes <= 0 or address <= 0:
            raise StartupError(f"MOONCAKE cannot register {nbytes} bytes at {address:#x}")
        for start, length in self._regions.items():
            if start < address + nbytes and address < start + length:
                raise StartupError(
                    f"MOONCAKE: [{address:#x}, +{nbytes}) overlaps the registered region "
                    f"[{start:#x}, +{length})"
                )
        rc = self._engine.register_memory(address, nbytes)
        if rc != 0:
            raise StartupError(
                f"MOONCAKE could not register {nbytes} bytes at {address:#x} (returned {rc})"
            )
        self._regions[address] = nbytes
        return _Registration(address, nbytes)

    def deregister(self, registration: object) -> None:
        if not isinstance(registration, _Registration):
            raise TransferError(f"MOONCAKE: {registration!r} is not one of its registrations")
        if self._regions.pop(registration.address, None) is None:
            return
        rc = self._engine.unregister_memory(registration.address)
        if rc != 0:
            raise TransferError(
                f"MOONCAKE could not unregister {registration.nbytes} bytes at "
                f"{registration.address:#x} (returned {rc})"
            )

    # ------------------------------------------------------------- peers

    def metadata(self) -> bytes:
        return encode_metadata(
            self.agent_name, self.session, list(self._regions.items()), self.engine_version
        )

    def add_peer(self, metadata: bytes) -> str:
        try:
            meta = decode_metadata(metadata)
        except ValueError as exc:
            raise TransferError(f"MOONCAKE: the peer's agent metadata is invalid: {exc}") from exc
        if meta.engine != self.engine_version:
            # "Completed" means "in the peer's memory" only under the acknowledged TCP
            # protocol, verified with one version; mixed versions are not vouched for.
            raise TransferError(
                f"MOONCAKE: peer {meta.agent} runs {PACKAGE} {meta.engine} and this daemon "
                f"{self.engine_version}; run the same version on both"
            )
        known = self._peers.get(meta.agent)
        if known is not None and known.meta.session == meta.session:
            known.meta = meta  # new registrations (a pools update): nothing to fetch
            return meta.agent
        for name, peer in self._peers.items():
            if peer.meta.session == meta.session and name != meta.agent:
                log.warning(
                    "MOONCAKE: peer %s reuses the engine address %s of %s; Mooncake may still "
                    "hold that engine's descriptor",
                    shown(meta.agent),
                    shown(meta.session),
                    shown(name),
                )
        self._fetch_segment(meta)
        self._peers[meta.agent] = _Peer(meta)
        return meta.agent

    def _fetch_segment(self, meta: PeerMetadata) -> None:
        """Have Mooncake fetch and cache the peer's segment descriptor now (see the
        module notes: a later fetch could hold the data-plane thread). No probe
        first: a bare connection to the peer's RPC port makes it log a warning."""
        first = self._engine.get_first_buffer_address(meta.session)
        if meta.regions and not first:
            raise TransferError(
                f"MOONCAKE could not fetch the segment descriptor of {meta.agent} from "
                f"{meta.session}: is its port reachable from here? (Mooncake's log on stderr "
                "says why)"
            )

    def remove_peer(self, agent_name: str) -> None:
        # Mooncake's Python API cannot drop its cached descriptor; forgetting the
        # name is what stops further writes to this peer.
        self._peers.pop(agent_name, None)

    def connect(self, agent_name: str) -> None:
        # The descriptor was fetched in add_peer; TCP connections open on first use.
        if agent_name not in self._peers:
            raise PeerLostError(f"MOONCAKE: no peer {agent_name} (never added, or removed)")

    def _reachable(self, session: str) -> bool:
        host, port = split_session(session)
        try:
            with socket.create_connection((host, port), timeout=self.probe_timeout_s):
                return True
        except OSError:
            return False

    # ------------------------------------------------------------ writes

    def post_write(
        self,
        local: Segments,
        remote: Segments,
        agent_name: str,
        notif: bytes = b"",
        *,
        local_memory: Memory = HOST,
        remote_memory: Memory = HOST,
        remote_regions: Sequence[tuple[int, int]] = (),
    ) -> tuple[XferHandle, XferStatus]:
        refused = host_only(self.name, local_memory, remote_memory)
        if refused is not None:
            raise TransferError(refused)
        if notif:
            raise TransferError(
                "MOONCAKE writes carry no notification (kvxferd reports completion on its "
                "peer channel)"
            )
        peer = self._peers.get(agent_name)
        if peer is None:
            raise PeerLostError(f"MOONCAKE: no peer {agent_name} (never added, or removed)")
        pairs = self._check_segments(local, remote, peer.meta)
        write = _Write(peer=agent_name, session=peer.meta.session, pending=[])
        handle = XferHandle(
            native=write,
            peer_agent=agent_name,
            nbytes=sum(n for _, _, n in pairs),
            descriptors=len(pairs),
        )
        for laddr, raddr, nbytes in pairs:
            batch = self._engine.transfer_submit_write(peer.meta.session, laddr, raddr, nbytes)
            if batch > 0:
                write.pending.append(int(batch))
                continue
            if not write.pending:
                # Nothing in flight: safe to raise (the caller holds no handle).
                raise self._failure(write, nbytes, "could not be submitted")
            # Some segments are in flight: the caller must release the handle.
            write.failed += 1
            write.error = self._failure(write, nbytes, "could not be submitted")
            return handle, XferStatus.ERROR
        return handle, XferStatus.IN_PROGRESS

    def _check_segments(
        self, local: Segments, remote: Segments, meta: PeerMetadata
    ) -> list[tuple[int, int, int]]:
        local = np.asarray(local)
        remote = np.asarray(remote)
        if local.ndim != 2 or local.shape[1] != 2 or local.shape != remote.shape or not len(local):
            raise TransferError(
                f"MOONCAKE: segments must be two equal, non-empty (N, 2) arrays, not "
                f"{local.shape} and {remote.shape}"
            )
        own = tuple(sorted(self._regions.items()))
        pairs: list[tuple[int, int, int]] = []
        for (laddr, lnbytes), (raddr, rnbytes) in zip(local.tolist(), remote.tolist(), strict=True):
            if lnbytes != rnbytes or lnbytes <= 0:
                raise TransferError(
                    f"MOONCAKE: segment lengths differ or are not positive ({lnbytes} local, "
                    f"{rnbytes} remote)"
                )
            if not _inside(own, laddr, lnbytes):
                raise TransferError(
                    f"MOONCAKE: local segment [{laddr:#x}, +{lnbytes}) is outside the memory "
                    "registered here"
                )
            if not _inside(meta.regions, raddr, rnbytes):
                raise TransferError(
                    f"MOONCAKE: remote segment [{raddr:#x}, +{rnbytes}) is outside the memory "
                    f"{meta.agent} registered"
                )
            pairs.append((int(laddr), int(raddr), int(lnbytes)))
        return pairs

    def _advance(self, write: _Write) -> None:
        """Ask Mooncake about every unfinished segment; forget the finished ones
        (Mooncake has freed their batch ids)."""
        still: list[int] = []
        for batch in write.pending:
            state = self._engine.transfer_check_status(batch)
            if state == _MC_DONE:
                continue
            if state == _MC_FAILED:
                write.failed += 1
                continue
            if state == _MC_TIMED_OUT:
                # Not freed by Mooncake and maybe still moving: failed, not finished.
                write.timed_out = True
            elif state != _MC_IN_PROGRESS:
                write.extra.append(f"unknown status {state}")
            still.append(batch)
        write.pending = still

    def _failure(self, write: _Write, nbytes: int, what: str) -> TransferError:
        if not self._reachable(write.session):
            return PeerLostError(
                f"MOONCAKE write to {write.peer} {what}: its transfer engine at {write.session} "
                "no longer accepts connections (peer gone)"
            )
        return TransferError(
            f"MOONCAKE write of {nbytes} bytes to {write.peer} {what}, though its engine at "
            f"{write.session} still accepts connections: the peer refused the write (memory "
            f"not registered there) or made no progress for {self.write_timeout_s} s (stopped "
            "or overloaded); Mooncake's log on stderr has the cause"
        )

    def poll(self, handle: XferHandle) -> XferStatus:
        write = handle.native
        assert isinstance(write, _Write)
        if write.error is not None:
            raise write.error
        self._advance(write)
        if write.failed or write.timed_out or write.extra:
            what = "failed" if write.failed else "timed out"
            if write.extra:
                what = f"failed ({', '.join(write.extra)})"
            write.error = self._failure(write, handle.nbytes, what)
            raise write.error
        return XferStatus.IN_PROGRESS if write.pending else XferStatus.DONE

    def release(self, handle: XferHandle) -> None:
        """Mark the handle released once Mooncake has finished every segment.

        Mooncake cannot cancel a write, so while any segment is in flight this
        refuses (raises TransferError) and the caller retries; Mooncake's own
        timeout ends a stuck write within `write_timeout_s`.
        """
        if handle.released:
            return
        write = handle.native
        assert isinstance(write, _Write)
        self._advance(write)
        if write.pending:
            raise TransferError(
                f"MOONCAKE cannot cancel a write: {len(write.pending)} segment(s) to "
                f"{write.peer} still in flight; Mooncake ends a stuck one after "
                f"{self.write_timeout_s} s without progress"
            )
        handle.released = True

    def close(self) -> None:
        # The engine stops its threads and listeners when it is freed; the daemon
        # closes the data plane only once every write is released.
        self._engine = None
        self._peers.clear()

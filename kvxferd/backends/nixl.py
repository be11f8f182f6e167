"""NIXL adapter: the only module that imports nixl_cu12.

Translates NIXL's string states ("DONE"/"PROC"/"ERR") into XferStatus and its
exception classes into kvxferd errors at this boundary. NIXL has no deadline of
its own; callers own every deadline and use `release` to cancel.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvxferd.backends.base import Segments, XferHandle, XferStatus
from kvxferd.errors import (
    BackendUnavailableError,
    PeerLostError,
    RemoteMemoryError,
    StartupError,
    TransferError,
)
from kvxferd.service.logs import TEXT_LIMIT, shown

log = logging.getLogger("kvxferd.backends.nixl")

_INSTALL_HINT = (
    "install it with `pip install --no-deps 'nixl-cu12>=1.5,<2'` (scripts/install.sh does this; "
    "--no-deps keeps nixl's declared torch dependency out)"
)

_STATUS = {"DONE": XferStatus.DONE, "PROC": XferStatus.IN_PROGRESS, "ERR": XferStatus.ERROR}

# NIXL exception class names that mean the remote side is gone.
_PEER_LOST_ERRORS = {"nixlRemoteDisconnectError"}


def _load() -> Any:
    try:
        import nixl_cu12
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend NIXL needs the nixl-cu12 package, which does not import ({exc}); "
            + _INSTALL_HINT
        ) from exc
    return nixl_cu12


# NIXL's Python API hard-codes its UCX progress thread's delay to 0, which makes
# that thread busy-poll a whole core for the life of the agent: two idle daemons
# then saturate a 2-core host. A delay of a few microseconds keeps the thread's
# idle cost near zero; transfers are still driven promptly by our own polls.
PROGRESS_DELAY_US = 10


def _make_agent(nixl: Any, agent_name: str, conf: Any, delay_us: int) -> Any:
    bindings = nixl._api.nixlBind
    real = bindings.nixlAgent

    def with_delay(name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = delay_us
        return real(name, agent_config)

    # nixl_agent builds its native config and agent inside __init__ with no hook
    # for this knob; swap the constructor for exactly that call.
    bindings.nixlAgent = with_delay
    try:
        return nixl.nixl_agent(agent_name, conf)
    finally:
        bindings.nixlAgent = real


def _translate(exc: Exception, what: str) -> TransferError:
    kind = type(exc).__name__
    if kind in _PEER_LOST_ERRORS:
        return PeerLostError(f"NIXL {what}: peer unreachable ({kind}: {exc})")
    return TransferError(f"NIXL {what} failed ({kind}: {exc})")


def _descs(segments: Segments) -> np.ndarray[Any, np.dtype[np.uint64]]:
    out = np.zeros((len(segments), 3), dtype=np.uint64)
    out[:, :2] = segments
    return out


class NixlBackend:
    """One NIXL agent with the UCX plugin, host (DRAM) memory."""

    name = "NIXL"

    def __init__(self, agent_name: str, progress_delay_us: int = PROGRESS_DELAY_US) -> None:
        nixl = _load()
        self.agent_name = agent_name
        try:
            # No listener thread: metadata travels over kvxferd's own
            # authenticated peer channel, never NIXL's unauthenticated one.
            conf = nixl.nixl_agent_config(enable_listen_thread=False, backends=["UCX"])
            self._agent = _make_agent(nixl, agent_name, conf, progress_delay_us)
        except Exception as exc:
            raise StartupError(f"NIXL agent {agent_name!r} could not start: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise StartupError(
                f"NIXL agent {agent_name!r} has no UCX plugin (available: "
                f"{self._agent.get_plugin_list()}); the nixl-cu12 install is incomplete"
            )

    def register(self, address: int, nbytes: int) -> object:
        try:
            return self._agent.register_memory([(address, nbytes, 0, "")], "DRAM")
        except Exception as exc:
            raise StartupError(
                f"NIXL could not register {nbytes} bytes at {address:#x}: {exc}"
            ) from exc

    def deregister(self, registration: object) -> None:
        self._agent.deregister_memory(registration)

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransferError(f"NIXL rejected the peer's agent metadata: {exc}") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, agent_name: str) -> None:
        try:
            self._agent.remove_remote_agent(agent_name)
        except Exception as exc:
            # Already gone is the state we wanted.
            log.debug("remove_remote_agent(%s): %s", shown(agent_name), shown(exc, TEXT_LIMIT))

    def connect(self, agent_name: str) -> None:
        # The first transfer to a new peer otherwise pays the connection set-up.
        try:
            self._agent.make_connection(agent_name)
        except Exception as exc:
            raise _translate(exc, f"connect to {agent_name}") from exc

    def post_write(
        self, local: Segments, remote: Segments, agent_name: str, notif: bytes = b""
    ) -> tuple[XferHandle, XferStatus]:
        try:
            ldescs = self._agent.get_xfer_descs(_descs(local), "DRAM")
            rdescs = self._agent.get_xfer_descs(_descs(remote), "DRAM")
            native = self._agent.initialize_xfer("WRITE", ldescs, rdescs, agent_name, notif)
        except Exception as exc:
            if type(exc).__name__ == "nixlNotFoundError":
                # Our side is our registered pool; what NIXL cannot find is the remote
                # range in the peer's registered memory.
                raise RemoteMemoryError(
                    f"NIXL transfer preparation: the receiver's addresses are not memory its "
                    f"agent {shown(agent_name)} registered ({shown(exc, TEXT_LIMIT)})"
                ) from exc
            raise _translate(exc, "transfer preparation") from exc
        handle = XferHandle(
            native=native,
            peer_agent=agent_name,
            nbytes=int(local[:, 1].sum()),
            descriptors=len(local),
        )
        try:
            state = self._agent.transfer(native)
        except Exception as exc:
            self.release(handle)
            raise _translate(exc, "transfer post") from exc
        status = _STATUS.get(state, XferStatus.ERROR)
        if status is XferStatus.DONE:
            # Over shared memory small writes complete inside the post: free the
            # handle now and save the caller a second trip to this thread. If NIXL
            # refuses, the handle stays unreleased and the caller retries.
            try:
                self.release(handle)
            except TransferError as exc:
                log.debug("release after an inline completion refused: %s", exc)
        return handle, status

    def poll(self, handle: XferHandle) -> XferStatus:
        try:
            state = self._agent.check_xfer_state(handle.native)
        except Exception as exc:
            raise _translate(exc, "transfer poll") from exc
        return _STATUS.get(state, XferStatus.ERROR)

    def release(self, handle: XferHandle) -> None:
        """Free the handle, cancelling the transfer if it is still active.

        NIXL refuses (raises) when an active transfer cannot be cancelled; the
        handle then stays unreleased and the caller must retry before it may
        hand the memory back.
        """
        if handle.released:
            return
        try:
            self._agent.release_xfer_handle(handle.native)
        except Exception as exc:
            raise _translate(exc, "transfer release") from exc
        handle.released = True

    def close(self) -> None:
        # nixl_agent frees its resources on garbage collection; drop our reference.
        self._agent = None

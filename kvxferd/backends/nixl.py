"""NIXL adapter: the only module that imports nixl (nixl_cu12 or nixl_cu13).

Translates NIXL's string states ("DONE"/"PROC"/"ERR") into XferStatus and its
exception classes into kvxferd errors at this boundary. NIXL has no deadline of
its own; callers own every deadline and use `release` to cancel.

NIXL ships one wheel per CUDA generation (nixl-cu12, nixl-cu13), each its own import
name; `nixl_module_name()` says which this process uses, and every other place that
names the package (the backend registry's probes, the bench's host record) asks it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import MutableMapping, Sequence
from typing import Any

import numpy as np

from kvxferd.backends.base import HOST, Memory, Segments, XferHandle, XferStatus
from kvxferd.backends.nixl_prepared import PreparedLists
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
    "install one with `pip install --no-deps 'nixl-cu12>=1.5,<2'` (or 'nixl-cu13>=1.5,<2' for "
    "CUDA 13 drivers; scripts/install.sh does this; --no-deps keeps nixl's declared torch "
    "dependency out)"
)

#: The import names of NIXL's wheels, in the order tried when nothing decides: cu12
#: first, so a host with both (or without CUDA, like CI) behaves as before cu13 existed.
NIXL_MODULES = ("nixl_cu12", "nixl_cu13")

#: Names the module to load (e.g. nixl_cu13), whatever else is installed.
MODULE_ENV = "KVXFERD_NIXL_MODULE"

_STATUS = {"DONE": XferStatus.DONE, "PROC": XferStatus.IN_PROGRESS, "ERR": XferStatus.ERROR}

# NIXL exception class names that mean the remote side is gone.
_PEER_LOST_ERRORS = {"nixlRemoteDisconnectError"}


def package_name(module: str) -> str:
    """The distribution (pip) name of a NIXL import name: nixl_cu13 -> nixl-cu13."""
    return module.replace("_", "-")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package or a bad name: not usable
        return False


def _driver_major() -> int | None:
    """The CUDA driver's major version if this process already knows a device, else None.

    Only asked when cupy is already imported (the daemon probed for device pools): the
    probe would otherwise import cupy and start CUDA in every host-only daemon."""
    if "cupy" not in sys.modules:
        return None
    from kvxferd.memory.device import probe

    found = probe()
    if not found.available or found.driver_version <= 0:
        return None
    return found.driver_version // 1000


def nixl_module_name() -> str | None:
    """The NIXL module this process uses (imports nothing: find_spec only), or None.

    KVXFERD_NIXL_MODULE decides when set (its module need not be installed: loading it
    then fails saying so). Otherwise, with a CUDA device already known, the installed
    wheel built for the driver's CUDA major (a cu12 build also runs on a CUDA 13 driver,
    not the other way round, so this is a preference); else the first installed of
    NIXL_MODULES. None: none is installed."""
    override = os.environ.get(MODULE_ENV, "").strip()
    if override:
        return override
    installed = [m for m in NIXL_MODULES if _installed(m)]
    major = _driver_major() if len(installed) > 1 else None
    if major is not None and f"nixl_cu{major}" in installed:
        return f"nixl_cu{major}"
    return installed[0] if installed else None


def _missing() -> str:
    return f"backend NIXL needs the {' or '.join(map(package_name, NIXL_MODULES))} package"


def load_nixl() -> Any:
    module = nixl_module_name()
    if module is None:
        raise BackendUnavailableError(f"{_missing()}, and neither is installed; " + _INSTALL_HINT)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        chosen = f" ({MODULE_ENV}={module})" if os.environ.get(MODULE_ENV, "").strip() else ""
        raise BackendUnavailableError(
            f"{_missing()}; {module}{chosen} does not import ({exc}); " + _INSTALL_HINT
        ) from exc


# NIXL's Python API hard-codes its UCX progress thread's delay to 0, which makes
# that thread busy-poll a whole core for the life of the agent: two idle daemons
# then saturate a 2-core host. A delay of a few microseconds keeps the thread's
# idle cost near zero; transfers are still driven promptly by our own polls.
PROGRESS_DELAY_US = 10


# UCX guards a worker with a spinlock when several threads use it (NIXL's progress thread and
# the data-plane thread that posts). A post over shared memory copies inside the call, holding
# the lock: a 16 MiB staged round keeps it ~3 ms, and the progress thread spins that long on
# the other core. Under the staged runtime that core is the gather's and the scatter's:
# with a mutex the progress thread sleeps instead, and staged NIXL moved 17 % more (3.4-3.5
# against 2.6-3.3 GB/s, 4 alternating passes; docs/benchmarks.md, issue 16 "the staged
# runtime"). The PYTHON runtime's bounce buffer and head slices copy on that core too, and
# take the mutex as well (2026-12-05: 5-23 % more GB/s in TP demos). Without a bounce buffer
# nothing else wants that core, and the spinning thread takes a share of a many-segment
# write's copies: the mutex cost it ~17 %, so it keeps UCX's default.
UCX_MUTEX_ENV = "UCX_USE_MT_MUTEX"


def prefer_mutex_worker_lock(env: MutableMapping[str, str] | None = None) -> bool:
    """Before the agent starts, where the daemon copies beside its writes (the staged runtime,
    a bounce buffer): UCX's worker lock as a mutex, unless the operator chose
    (UCX_USE_MT_MUTEX set). True when this set it."""
    env = os.environ if env is None else env
    if UCX_MUTEX_ENV in env:
        return False
    env[UCX_MUTEX_ENV] = "y"
    return True


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


# Up to this many segments a list of tuples is the cheaper form to hand NIXL (measured:
# 1.8 against 3.4 us for one segment, even at ~8; 11 against 4 us at 64).
_TUPLES_MAX = 8


def _descs(
    segments: Segments, device: int = 0
) -> np.ndarray[Any, np.dtype[np.uint64]] | list[tuple[int, int, int]]:
    """NIXL's (address, length, device) transfer descriptors; the device column is the
    CUDA ordinal for VRAM and 0 for DRAM. A few are tuples: a small request's post makes
    two of these lists, and numpy's fixed costs were most of their price."""
    if len(segments) <= _TUPLES_MAX:
        return [(address, length, device) for address, length in segments.tolist()]
    out = np.zeros((len(segments), 3), dtype=np.uint64)
    out[:, :2] = segments
    out[:, 2] = device
    return out


def _as(memory: Memory) -> str:
    """The words naming device memory in a message; none for host memory (as before)."""
    return f" as VRAM on device {memory.device}" if memory.on_device else ""


def _register_failure(address: int, nbytes: int, memory: Memory, exc: Exception) -> str:
    """Why a registration failed, NIXL's own words kept. NIXL raises only a status name
    (NIXL_ERR_BACKEND) and logs the cause on stderr; for VRAM the usual cause is a UCX
    without CUDA support, which then sees the address as host memory."""
    where = f"{memory.kind} on CUDA device {memory.device}" if memory.on_device else "DRAM"
    text = f"NIXL could not register {nbytes} bytes at {address:#x} as {where}: {exc}"
    if memory.on_device:
        text += (
            " (if NIXL's log says 'VRAM memory is detected as host by UCX', the address is not "
            "device memory UCX can see, or this NIXL/UCX build lacks CUDA support)"
        )
    return text


class NixlBackend:
    """One NIXL agent with the UCX plugin, host (DRAM) and device (VRAM) memory."""

    name = "NIXL"
    # The agent runs without internal locking (sync mode NONE: no listener thread) and
    # takes calls from any thread as long as they come one at a time, which the data
    # plane's lock guarantees; small posts, polls and releases then skip the hop to the
    # data-plane thread (transceiver/dataplane.py).
    inline_calls = True

    def __init__(self, agent_name: str, progress_delay_us: int = PROGRESS_DELAY_US) -> None:
        nixl = load_nixl()
        self.module = nixl.__name__  # which wheel, for the logs and the status page
        self.agent_name = agent_name
        try:
            # No listener thread: metadata travels over kvxferd's own
            # authenticated peer channel, never NIXL's unauthenticated one.
            conf = nixl.nixl_agent_config(enable_listen_thread=False, backends=["UCX"])
            self._agent = _make_agent(nixl, agent_name, conf, progress_delay_us)
        except Exception as exc:
            raise StartupError(f"NIXL agent {agent_name!r} could not start: {exc}") from exc
        self._prepared = PreparedLists(self._agent)
        if "UCX" not in self._agent.backends:
            raise StartupError(
                f"NIXL agent {agent_name!r} has no UCX plugin (available: "
                f"{self._agent.get_plugin_list()}); the {package_name(self.module)} install is "
                "incomplete"
            )

    def register(self, address: int, nbytes: int, memory: Memory = HOST) -> object:
        try:
            registration = self._agent.register_memory(
                [(address, nbytes, memory.device, "")], memory.kind
            )
        except Exception as exc:
            raise StartupError(_register_failure(address, nbytes, memory, exc)) from exc
        self._prepared.registered(registration, address, nbytes, memory)
        return registration

    def deregister(self, registration: object) -> None:
        self._prepared.deregistered(registration)
        self._agent.deregister_memory(registration)

    @property
    def prepared_writes(self) -> int:
        """Writes posted from prepared descriptor lists (kvxferd.backends.nixl_prepared)."""
        return self._prepared.prepared_writes

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransferError(f"NIXL rejected the peer's agent metadata: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._prepared.peer_reloaded(name)
        return name

    def remove_peer(self, agent_name: str) -> None:
        self._prepared.peer_reloaded(agent_name)
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
        try:
            native = self._prepared.make(
                local, remote, agent_name, notif, local_memory, remote_memory, remote_regions
            )
            if native is None:
                # Each side names its own memory kind and device: NIXL finds the
                # registration by (kind, device, address range), so a wrong kind is "not
                # registered".
                ldescs = self._agent.get_xfer_descs(
                    _descs(local, local_memory.device), local_memory.kind
                )
                rdescs = self._agent.get_xfer_descs(
                    _descs(remote, remote_memory.device), remote_memory.kind
                )
                native = self._agent.initialize_xfer("WRITE", ldescs, rdescs, agent_name, notif)
        except Exception as exc:
            if type(exc).__name__ == "nixlNotFoundError":
                # Our side is our registered pool; what NIXL cannot find is the remote
                # range in the peer's registered memory.
                raise RemoteMemoryError(
                    f"NIXL transfer preparation: the receiver's addresses are not memory its "
                    f"agent {shown(agent_name)} registered{_as(remote_memory)} "
                    f"({shown(exc, TEXT_LIMIT)})"
                ) from exc
            raise _translate(exc, "transfer preparation") from exc
        handle = XferHandle(
            native=native,
            peer_agent=agent_name,
            nbytes=sum(local[:, 1].tolist()),  # a few runs: cheaper than numpy's sum
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
        if self._agent is not None:
            self._prepared.close()
        self._agent = None

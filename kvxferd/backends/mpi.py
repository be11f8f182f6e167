"""MPI adapter for the staged (CPP) runtime: the only module that imports mpi4py.

MPI is the legacy two-sided path (docs/backends-mpi.md). Each round of a
request crosses as ONE tagged message from the context daemon's staging
buffer to the generation daemon's, over MPICH (the `mpich` wheel) through
mpi4py's buffer API: raw bytes only, never mpi4py's pickle-based calls. MPI
errors become kvxferd errors here: PeerLostError when the peer is gone,
TransferTimeoutError for a receive deadline, TransferError otherwise,
BackendUnavailableError when mpi4py (or the MPI library) does not load.

Daemons started on their own
----------------------------
The daemons are separate `kvxferd run` processes, so they meet through MPI's
dynamic process calls (MPI_Open_port, MPI_Comm_accept, MPI_Comm_connect), one
intercommunicator per pair. MPICH 5.0's singleton init (a process not started
by mpiexec) cannot do that with another singleton: both name their world
"singinit", so each takes the other for itself and MPI_Comm_accept/connect fail
with "Local and remote groups ... must not overlap" (pmodels/mpich#7805). A
process started by hydra's mpiexec has a world name of its own and connects
fine. So, unless the process already runs under a process manager (PMI_FD,
PMI_PORT or PMIX_NAMESPACE set), the first transport of a process gives it
one before initialising MPI: it starts `mpiexec -n 1` on a tiny helper that
hands its PMI connection (the socket in PMI_FD) to this process over a Unix
socket, then waits. MPI_Init here then runs as hydra's rank 0 of a world of
one. The helper (and mpiexec with it) exits when this process closes its end,
at exit or death. KVXFERD_MPI_BOOTSTRAP=off skips this (a singleton can still
connect to a peer that runs under a process manager); KVXFERD_MPIEXEC names
the mpiexec to use (default: the one next to the Python interpreter, then
PATH). MPI is never finalised (mpi4py.rc.finalize False): MPI_Finalize would
wait on peers, and the process is leaving anyway.

Connections
-----------
`start` opens a TCP listener ("host:port" is the address the daemon
advertises). `connect` opens a TCP connection to it and sends a hello with
our key ("daemon_name/incarnation"); the listener opens an MPI port just for
this connection, starts MPI_Comm_accept on it in a thread, and answers with
its own key and the port name; the connecting side checks the key (a
restarted peer answers with a new incarnation and is refused), runs
MPI_Comm_connect in a thread, and waits for the listener's "ready", sent once
the intercommunicator is registered. Either side may then send to and
receive from the other. Why TCP beside MPI:

* a blocked MPI_Comm_accept spins (half a core here), so accept runs only
  while a peer is known to be connecting, on a port of its own;
* MPICH does not notice a dead peer: a receive from a SIGKILLed process stays
  pending forever (measured with both the ucx and the ofi netmod, 20 s+). The
  TCP connection stays open for the life of the link; the kernel closes it
  when the peer dies, and its EOF marks the link lost, which fails that
  peer's pending sends and receives with PeerLostError within milliseconds.
  remove_peer closes it, which tells the peer.

Messages and tags
-----------------
MPI tags stop at MPI_TAG_UB (2**29 - 1 with MPICH; the standard only promises
32767), the staged runtime's are 63-bit. So a message is two MPI messages on
the link's intercommunicator: a 24-byte header with tag 0 (magic, the 64-bit
tag, the size, a data tag) and the payload with the data tag, a per-link
sequence number in 1..MPI_TAG_UB. Receiving a tag means reading headers (in
arrival order, into a per-peer table) until that tag's header is there, then
receiving the payload by its data tag. One recv per peer and tag at a time.

Receive deadlines and late messages
-----------------------------------
The payload is received into a private scratch buffer and copied into `out`
only once complete, on the event loop, right before `recv` returns. An MPI
receive cannot be taken back once it has matched a message (MPI_Cancel only
cancels unmatched ones) and, as above, one from a dead peer never ends: going
through scratch is what guarantees that nothing lands in `out` after `recv`
returned, timed out, was cancelled or failed. An abandoned receive keeps its
scratch buffer until MPI is done with it (forever, if the peer died mid-
message). The price is one memcpy per message.

The deadline bounds the wait for the header; a message whose header came in
time gets `stall_grace_s` more to arrive whole, after which the link is
closed (PeerLostError). A tag whose recv timed out is abandoned: its late
message is received into scratch and dropped, so the sender's `send`
completes and the stale bytes never reach a later recv of that tag. A new
recv of an abandoned tag takes it back; abandoned tags are forgotten after
`abandon_ttl_s` or when the peer is removed.

`send` returns once MPI no longer reads `data` (for a large message: once the
receiver took it). If it must give up first, it raises PeerLostError when
the link is lost; when its task is cancelled it waits `stall_grace_s` for
MPI to finish, then closes the link, so the peer fails that receive instead
of using it. MPI cannot abort a send: in both cases it may go on reading
`data` for a message that was mid-way, into the peer's scratch buffer only,
which that peer drops.

Surviving a peer's death
------------------------
MPICH was not made for peers that die: measured with MPICH 5.0.2 here,

* with its default transports (UCX, shared memory with CMA), a sender killed
  mid-message makes UCX abort the RECEIVING process (process_vm_readv fails,
  "No such process", SIGABRT);
* with the ofi netmod (libfabric tcp), the error completion of an operation
  to a dead peer is fatal to MPICH whatever the error handler (SIGABRT or
  exit), in one kill out of two;
* with the ucx netmod over TCP, or over shared memory without CMA
  (UCX_TLS=^cma), a kill mid-message leaves the survivor's requests pending
  forever but alive (no abort in 40 kills, either side): the TCP watch above
  then fails them;
* with any of them, a peer that dies DURING MPI_Comm_connect/accept (the
  link's set-up, ~10 ms over shared memory, 30-55 ms over TCP) makes MPICH
  crash the other side with SIGSEGV (it releases UCX's error status as a
  request, or sends on the endpoint it failed to create).

So, unless set already, MPIR_CVAR_CH4_NETMOD=ucx and UCX_TLS=^cma (UCX's
shared memory without CMA on one host, TCP or what else UCX finds between
hosts, with 1 MiB TCP segments), and links are made when a peer is accepted
rather than at its first round (`link_ahead`: the daemon connects right after
the peer handshake), which keeps set-up away from transfers. Measured with
`kvxferd bench --runtime CPP` (1000 and 8000 tokens, 4 MiB blocks): 1.55 and
1.98 GB/s with UCX_TLS=^cma, 0.52 and 1.44 with UCX_TLS=tcp,self. With links
made ahead, no survivor died in 70 kills mid-transfer (nor in 40 over TCP);
with links made at the first round, 3 of 40 did (6 of 24 over TCP). A daemon can still
crash if its peer dies within the milliseconds of set-up; it is meant to run
under a supervisor that restarts it (the systemd unit does).

Progress
--------
MPI moves data only inside MPI calls. Everything runs on the daemon's event
loop, except MPI_Comm_accept/connect (threads; MPI_THREAD_MULTIPLE): waits
test their requests, yielding to the loop between tests, and spin (yield
only) for up to 2 s while a payload moves (two bare processes here: 0.5 GB/s
when tested every millisecond; 1.3 over shared memory and 2.0 over TCP when
both sides spin); other waits back off to one test a millisecond. While a
link exists a background tick calls MPI every 5 ms (reading headers,
draining late messages), so that what one side queued moves even when
neither side waits on it: about 1.5 % of a core per idle daemon here.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kvxferd.errors import (
    BackendUnavailableError,
    PeerLostError,
    StartupError,
    TransferError,
    TransferTimeoutError,
)

log = logging.getLogger("kvxferd.backends.mpi")

_INSTALL_HINT = (
    "install it with `pip install mpi4py mpich` (the mpich wheel brings libmpi and mpiexec)"
)

BOOTSTRAP_ENV = "KVXFERD_MPI_BOOTSTRAP"
MPIEXEC_ENV = "KVXFERD_MPIEXEC"
# Variables that say a process manager started this process (hydra, slurm, PMIx).
_PM_ENV = ("PMI_FD", "PMI_PORT", "PMIX_NAMESPACE")
# How long starting mpiexec and receiving its PMI connection may take.
_BOOTSTRAP_TIMEOUT_S = 30.0
# MPICH's own bound on MPI_Comm_connect (seconds), unless set: a connect
# thread whose peer vanished mid-handshake ends instead of waiting 180 s.
_CONNECT_TIMEOUT_CVAR = "MPIR_CVAR_CH4_COMM_CONNECT_TIMEOUT"
_CONNECT_TIMEOUT_DEFAULT = "30"
# MPICH's network module and UCX's transports, unless set: see "Surviving a
# peer's death" in the module docstring.
_NETMOD_CVAR = "MPIR_CVAR_CH4_NETMOD"
DEFAULT_NETMOD = "ucx"
UCX_DEFAULTS = {
    # Every transport but CMA, whose failed read of a dead peer aborts us.
    "UCX_TLS": "^cma",
    # Where UCX uses TCP (between hosts), 1 MiB segments: 1.7-2.0 GB/s over
    # loopback here, against 0.26 with UCX's own.
    "UCX_TCP_TX_SEG_SIZE": "1M",
    "UCX_TCP_RX_SEG_SIZE": "1M",
    # UCX warns about variables meant for other UCX users.
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}

# Run by `mpiexec -n 1`: hand the PMI socket and the PMI variables to the
# process listening on argv[1], then live until it closes the connection.
_PMI_HELPER = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
env = "\\n".join(k + "=" + v for k, v in os.environ.items() if k.startswith(("PMI_", "MPI_LOCAL")))
socket.send_fds(s, [env.encode()], [int(os.environ["PMI_FD"])])
while s.recv(64):
    pass
"""

# Run (under mpiexec when there is one) to end an MPI_Comm_accept whose peer
# never connected: connecting completes it. Exits without MPI_Finalize.
_ACCEPT_RELEASER = """
import sys, mpi4py
mpi4py.rc.finalize = False
from mpi4py import MPI
MPI.COMM_SELF.Connect(sys.argv[1])
"""

# The TCP rendezvous: frames of magic, version, kind, then length-prefixed fields.
_MAGIC = b"KVXM"
_VERSION = 1
_FRAME_HEAD = struct.Struct("!4sBBB")  # magic, version, kind, number of fields
_FIELD_LEN = struct.Struct("!H")
_MAX_FIELD = 4096
_HELLO, _ACK, _READY = 1, 2, 3
# How long a listener waits for a connecting peer's hello, and for its MPI side.
HELLO_TIMEOUT_S = 10.0

# Per message, tag 0 on the intercommunicator: magic, 64-bit tag, size, data tag.
_HEADER = struct.Struct("<4sQQI")
_HEADER_MAGIC = b"KVXH"
_HEADER_TAG = 0

# Waiting: the first polls only yield to the loop, later ones sleep this long.
_POLL_SPINS = 32
_POLL_MAX_SLEEP_S = 0.001
# While a link exists, MPI is called this often regardless (see "Progress").
_TICK_S = 0.005
# A transfer spins while its payload moves, for up to this long, then backs off.
_PAYLOAD_SPIN_S = 2.0
# A payload still arriving when its link is lost gets this long to complete.
_LOST_GRACE_S = 0.1
# Receives abandoned for a peer that is gone may never end: look at them rarely.
_STUCK_PERIOD_S = 0.5
# Scratch buffers kept for reuse (each up to the largest message received).
_SCRATCH_KEEP = 4

T = TypeVar("T")


def _load() -> Any:
    try:
        # importlib keeps the untyped package out of mypy's sight. This imports
        # only the package: MPI itself loads and initialises on first use.
        return importlib.import_module("mpi4py")
    except (ImportError, OSError) as exc:
        raise BackendUnavailableError(
            f"backend MPI needs the mpi4py package, which does not import ({exc}); " + _INSTALL_HINT
        ) from exc


# ---------------------------------------------------------------------------
# The process's MPI: bootstrapped and initialised once, never finalised.
# ---------------------------------------------------------------------------


@dataclass
class _Runtime:
    MPI: Any
    tag_ub: int
    mode: str  # "process manager", "bootstrapped" or "singleton"
    # The bootstrap helper: its mpiexec and our end of its Unix socket.
    helper: subprocess.Popen[bytes] | None = None
    helper_conn: socket.socket | None = None


_process_lock = threading.Lock()
_process_rt: _Runtime | None = None


def _find_mpiexec() -> str | None:
    named = os.environ.get(MPIEXEC_ENV)
    if named:
        return named
    here = os.path.dirname(sys.executable)
    return shutil.which("mpiexec", path=here) or shutil.which("mpiexec")


def _accept_helper(
    listener: socket.socket, proc: subprocess.Popen[bytes], deadline: float
) -> socket.socket:
    while True:
        try:
            return listener.accept()[0]
        except TimeoutError:
            pass
        if proc.poll() is not None:
            raise OSError(
                f"it exited with status {proc.returncode} before handing over a PMI "
                "connection (is it MPICH's hydra mpiexec?)"
            )
        if time.monotonic() > deadline:
            raise OSError(f"no PMI connection within {_BOOTSTRAP_TIMEOUT_S:g}s")


def _bootstrap_process_manager(mpiexec: str) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Become rank 0 of a one-process hydra job: see the module docstring."""
    tmpdir = tempfile.mkdtemp(prefix="kvxferd-mpi-")
    path = os.path.join(tmpdir, "pmi.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    proc: subprocess.Popen[bytes] | None = None
    try:
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(0.1)
        proc = subprocess.Popen(
            [mpiexec, "-n", "1", sys.executable, "-c", _PMI_HELPER, path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            # Its own session: a Ctrl-C or a signal to our process group goes to
            # us only; the helper follows when we close the connection.
            start_new_session=True,
        )
        conn = _accept_helper(listener, proc, time.monotonic() + _BOOTSTRAP_TIMEOUT_S)
        conn.settimeout(_BOOTSTRAP_TIMEOUT_S)
        msg, fds, _, _ = socket.recv_fds(conn, 65536, 1)
        if len(fds) != 1:
            raise OSError("the helper sent no PMI socket")
        conn.settimeout(None)
    except (TimeoutError, OSError) as exc:
        if proc is not None:
            proc.kill()
            proc.wait()
        raise StartupError(
            f"MPI: could not get a process manager from `{mpiexec} -n 1` ({exc}); set "
            f"{BOOTSTRAP_ENV}=off to run as an MPI singleton, or start the daemon under "
            "`mpiexec -n 1`"
        ) from exc
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(tmpdir)
    os.set_inheritable(fds[0], False)
    for line in msg.decode().splitlines():
        name, _, value = line.partition("=")
        os.environ[name] = value
    os.environ["PMI_FD"] = str(fds[0])
    return proc, conn


def _unlink_world_shm() -> None:
    """Unlink the /dev/shm file MPICH made for this process's world at MPI_Init.

    MPICH removes it in MPI_Finalize, which never runs here: each daemon start
    (and each kill) would leave 1 MiB behind. Called for a world of one
    process only, which nobody else attaches to; the mapping stays valid.
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "/mpich_shm_" in line}
    except OSError:
        return
    for path in paths:
        if path.startswith("/dev/shm/mpich_shm_") and not path.endswith("(deleted)"):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _init_runtime() -> _Runtime:
    mpi4py = _load()
    global _process_rt
    with _process_lock:
        if _process_rt is not None:
            return _process_rt
        helper: tuple[subprocess.Popen[bytes], socket.socket] | None = None
        set_env: list[str] = []
        already = "mpi4py.MPI" in sys.modules and sys.modules["mpi4py.MPI"].Is_initialized()
        if already:
            mode = "initialised elsewhere"
        elif any(name in os.environ for name in _PM_ENV):
            mode = "process manager"
        elif os.environ.get(BOOTSTRAP_ENV, "auto").lower() in {"off", "0", "no", "false"}:
            mode = "singleton"
        else:
            mpiexec = _find_mpiexec()
            if mpiexec is None:
                mode = "singleton"
                log.warning(
                    "MPI: no mpiexec found (set %s); running as an MPI singleton, which "
                    "cannot connect to another singleton (pmodels/mpich#7805)",
                    MPIEXEC_ENV,
                )
            else:
                before = set(os.environ)
                helper = _bootstrap_process_manager(mpiexec)
                set_env = [k for k in os.environ if k not in before] + ["PMI_FD"]
                mode = "bootstrapped"
        if not already:
            os.environ.setdefault(_CONNECT_TIMEOUT_CVAR, _CONNECT_TIMEOUT_DEFAULT)
            os.environ.setdefault(_NETMOD_CVAR, DEFAULT_NETMOD)
            for name, value in UCX_DEFAULTS.items():
                os.environ.setdefault(name, value)
            mpi4py.rc.initialize = False
            mpi4py.rc.finalize = False
        try:
            MPI = importlib.import_module("mpi4py.MPI")
            if not MPI.Is_initialized():
                MPI.Init_thread(MPI.THREAD_MULTIPLE)
        except (ImportError, OSError) as exc:
            raise BackendUnavailableError(
                f"backend MPI: mpi4py's MPI module does not load ({exc}); " + _INSTALL_HINT
            ) from exc
        except Exception as exc:
            raise StartupError(f"MPI could not initialise ({mode}): {exc}") from exc
        finally:
            # Read by MPI_Init only; a child of ours must not take our PMI socket
            # number for its own.
            for name in set_env:
                os.environ.pop(name, None)
        if not already and MPI.COMM_WORLD.Get_size() == 1:
            _unlink_world_shm()  # no other local rank of our world will attach
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            raise StartupError(
                f"MPI provides thread level {provided}, the MPI backend needs "
                "MPI_THREAD_MULTIPLE (accept and connect run in threads)"
            )
        for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):
            comm.Set_errhandler(MPI.ERRORS_RETURN)
        tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
        _process_rt = _Runtime(
            MPI,
            tag_ub,
            mode,
            helper[0] if helper else None,
            helper[1] if helper else None,
        )
        log.info(
            "MPI initialised (%s): %s, netmod %s, UCX_TLS %s, tag upper bound %d",
            mode,
            MPI.Get_library_version().splitlines()[0].strip(),
            os.environ.get(_NETMOD_CVAR, "MPICH's default"),
            os.environ.get("UCX_TLS", "UCX's default"),
            tag_ub,
        )
        return _process_rt


# ---------------------------------------------------------------------------
# TCP rendezvous frames.
# ---------------------------------------------------------------------------


def _frame(kind: int, *fields: bytes) -> bytes:
    out = [_FRAME_HEAD.pack(_MAGIC, _VERSION, kind, len(fields))]
    for f in fields:
        if len(f) > _MAX_FIELD:
            raise StartupError(f"MPI rendezvous field of {len(f)} bytes is too long")
        out += [_FIELD_LEN.pack(len(f)), f]
    return b"".join(out)


async def _read_frame(reader: asyncio.StreamReader, expect: int) -> list[bytes]:
    magic, version, kind, n = _FRAME_HEAD.unpack(await reader.readexactly(_FRAME_HEAD.size))
    if magic != _MAGIC or version != _VERSION or kind != expect:
        raise TransferError(
            f"not a kvxferd MPI rendezvous frame (magic {magic!r}, version {version}, "
            f"kind {kind}); another program, or another kvxferd version, is on that port"
        )
    fields = []
    for _ in range(n):
        (length,) = _FIELD_LEN.unpack(await reader.readexactly(_FIELD_LEN.size))
        fields.append(await reader.readexactly(length))
    return fields


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransferError(f"MPI peer address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _flat(buf: memoryview, what: str) -> memoryview:
    if not buf.c_contiguous:
        raise TransferError(f"MPI {what} needs a contiguous buffer")
    return buf if buf.ndim == 1 and buf.format == "B" else buf.cast("B")


def _in_thread(fn: Callable[[], T], name: str) -> asyncio.Future[T]:
    """Run a blocking MPI call in a daemon thread (never joined: an MPI call
    that never returns must not hold up the exit of the process)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)

    def run() -> None:
        try:
            value, error = fn(), None
        except BaseException as exc:
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is gone
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


# ---------------------------------------------------------------------------
# Links, peers, scratch.
# ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Link:
    """One intercommunicator with a peer, and the TCP connection that watches it."""

    comm: Any
    writer: asyncio.StreamWriter
    tag_ub: int
    lost: str | None = None
    header_buf: bytearray = field(default_factory=lambda: bytearray(_HEADER.size))
    header_req: Any = None
    last_tag: int = 0
    watcher: asyncio.Task[None] | None = None

    def next_tag(self) -> int:
        self.last_tag = self.last_tag % self.tag_ub + 1
        return self.last_tag


@dataclass(eq=False)
class _Peer:
    key: str
    links: list[_Link] = field(default_factory=list)
    # 64-bit tag -> headers arrived and not yet received: (link, size, data tag).
    pending: dict[int, deque[tuple[_Link, int, int]]] = field(default_factory=dict)

    def live_link(self) -> _Link | None:
        for link in self.links:
            if link.lost is None:
                return link
        return None

    def lost_reason(self) -> str:
        reasons = [link.lost for link in self.links if link.lost]
        return reasons[-1] if reasons else "no connection"


class _ScratchPool:
    """Receive buffers, reused: a fresh one costs a page fault per 4 KiB."""

    def __init__(self) -> None:
        self._free: list[np.ndarray[Any, np.dtype[np.uint8]]] = []

    def take(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        # By index: list.remove would compare arrays element by element.
        fits = [i for i, b in enumerate(self._free) if nbytes <= b.nbytes <= 2 * nbytes + (1 << 20)]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def give(self, buf: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        self._free.append(buf)
        if len(self._free) > _SCRATCH_KEEP:
            smallest = min(range(len(self._free)), key=lambda i: self._free[i].nbytes)
            self._free.pop(smallest)


@dataclass(eq=False)
class _Zombie:
    """An abandoned MPI request and the buffer it may still use."""

    req: Any
    buf: object
    peer_key: str
    link: _Link
    since: float = field(default_factory=time.monotonic)


class MpiTransport:
    """Tagged messages between daemons over MPI (mpi4py + MPICH).

    Runs on the daemon's event loop; not thread-safe. See the module docstring.
    """

    name = "MPI"
    # Asks the daemon to connect when a peer is accepted rather than at its
    # first round: see "Surviving a peer's death" in the module docstring.
    link_ahead = True

    def __init__(
        self,
        daemon_name: str,
        incarnation: str,
        *,
        stall_grace_s: float = 5.0,
        abandon_ttl_s: float = 120.0,
    ) -> None:
        self._mpi4py = _load()
        self.key = f"{daemon_name}/{incarnation}"
        if len(self.key.encode()) > _MAX_FIELD:
            raise StartupError(f"MPI peer key {self.key[:40]!r}... is too long")
        self._stall_grace_s = stall_grace_s
        self._abandon_ttl_s = abandon_ttl_s
        self._rt: _Runtime | None = None
        self._server: asyncio.base_events.Server | None = None
        self._peers: dict[str, _Peer] = {}
        # (peer key, tag) -> when it is forgotten; see recv.
        self._abandoned: dict[tuple[str, int], float] = {}
        self._zombies: list[_Zombie] = []
        self._ticker: asyncio.Task[None] | None = None
        self._receiving: set[tuple[str, int]] = set()
        self._scratch = _ScratchPool()
        self._handshakes: set[asyncio.Task[None]] = set()
        self._connecting: dict[str, asyncio.Future[None]] = {}
        self._closed = False

    # -- set-up ------------------------------------------------------------

    async def _runtime(self) -> _Runtime:
        if self._closed:
            raise TransferError(f"MPI transport {self.key} is closed")
        if self._rt is None:
            # Off the loop: the bootstrap starts mpiexec and waits for it.
            rt = _process_rt
            self._rt = rt if rt is not None else await asyncio.to_thread(_init_runtime)
        return self._rt

    @property
    def mode(self) -> str | None:
        """How MPI was initialised ("bootstrapped", "process manager", ...), or None."""
        return None if self._rt is None else self._rt.mode

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Initialise MPI and listen for peers; returns "host:port" to advertise."""
        await self._runtime()
        if self._server is not None:
            raise StartupError(f"MPI transport {self.key} is already listening")
        try:
            self._server = await asyncio.start_server(self._on_client, host, port)
        except OSError as exc:
            raise StartupError(f"MPI could not listen on {host}:{port}: {exc}") from exc
        bound = self._server.sockets[0].getsockname()[1]
        return f"{host}:{bound}"

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handshakes.add(task)
        try:
            await self._accept(reader, writer)
        finally:
            self._handshakes.discard(task)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Listener side of the rendezvous: hello, MPI accept, register, ready."""
        rt = await self._runtime()
        MPI = rt.MPI
        key: str | None = None
        port: str | None = None
        accepting: asyncio.Future[Any] | None = None
        try:
            (raw_key,) = await asyncio.wait_for(_read_frame(reader, _HELLO), HELLO_TIMEOUT_S)
            key = raw_key.decode()
            port = MPI.Open_port()
            accepting = _in_thread(lambda: MPI.COMM_SELF.Accept(port), "kvxferd-mpi-accept")
            writer.write(_frame(_ACK, self.key.encode(), port.encode()))
            await writer.drain()
            # The peer now connects; if its TCP side closes first, it never will.
            closed = asyncio.ensure_future(reader.read(1))
            done, _ = await asyncio.wait(
                {accepting, closed}, timeout=HELLO_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
            if accepting not in done:
                closed.cancel()
                raise TransferError("the peer did not complete MPI_Comm_connect")
            if closed in done:
                raise TransferError("the peer closed the rendezvous during MPI_Comm_connect")
            closed.cancel()
            comm = accepting.result()
            accepting = None
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            if self._closed:
                raise TransferError("transport closed")
            self._register(key, comm, reader, writer, rt)
            writer.write(_frame(_READY))
            await writer.drain()
        except (Exception, asyncio.CancelledError) as exc:
            log.warning("MPI: refused an incoming connection (peer %s): %s", key, exc)
            if key is not None and key in self._peers:
                self._drop_links(self._peers[key], f"rendezvous failed: {exc}", writer)
            writer.close()
            if accepting is not None and port is not None:
                self._release_accept(accepting, port, rt)
            elif port is not None:
                with contextlib.suppress(Exception):
                    MPI.Close_port(port)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        with contextlib.suppress(Exception):
            MPI.Close_port(port)
        log.info("MPI: peer %s connected to us", key)

    def _release_accept(self, accepting: asyncio.Future[Any], port: str, rt: _Runtime) -> None:
        """End an MPI_Comm_accept whose peer will never connect: it would spin forever.

        MPI has no way to cancel it; a throwaway process connecting to the port
        completes it. Its intercommunicator is freed, the port closed.
        """
        MPI = rt.MPI

        def done(fut: asyncio.Future[Any]) -> None:
            if not fut.cancelled() and fut.exception() is None:
                with contextlib.suppress(Exception):
                    fut.result().Free()
            with contextlib.suppress(Exception):
                MPI.Close_port(port)

        accepting.add_done_callback(done)
        if accepting.done():
            return
        mpiexec = _find_mpiexec()
        cmd = [sys.executable, "-c", _ACCEPT_RELEASER, port]
        if mpiexec is not None and rt.mode != "singleton":
            cmd = [mpiexec, "-n", "1", *cmd]

        def run() -> None:
            try:
                subprocess.run(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=120,
                    start_new_session=True,
                    check=False,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("MPI: could not release an abandoned MPI_Comm_accept: %s", exc)

        log.info("MPI: releasing an MPI_Comm_accept whose peer went away")
        threading.Thread(target=run, name="kvxferd-mpi-release", daemon=True).start()

    async def connect(self, peer_key: str, address: str, timeout_s: float) -> None:
        """Rendezvous with the peer listening at `address`; ends with an intercommunicator.

        Returns at once when a live link to that peer exists (in either
        direction); concurrent calls for one peer share one rendezvous.
        """
        rt = await self._runtime()
        peer = self._peers.get(peer_key)
        if peer is not None and peer.live_link() is not None:
            return
        pending = self._connecting.get(peer_key)
        if pending is None:
            pending = asyncio.ensure_future(self._connect(rt, peer_key, address, timeout_s))
            self._connecting[peer_key] = pending
            pending.add_done_callback(lambda f: self._connected(peer_key, f))
        # Shielded: one caller giving up must not abandon the others' rendezvous.
        await asyncio.shield(pending)

    def _connected(self, peer_key: str, fut: asyncio.Future[None]) -> None:
        self._connecting.pop(peer_key, None)
        if not fut.cancelled():
            fut.exception()  # retrieved, even when every caller gave up waiting

    async def _connect(self, rt: _Runtime, peer_key: str, address: str, timeout_s: float) -> None:
        MPI = rt.MPI
        host, port = _split_address(address)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        def remaining() -> float:
            return max(deadline - loop.time(), 0.001)

        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), remaining()
            )
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise TransferTimeoutError(
                f"MPI connect to {peer_key} at {address}: no answer within {timeout_s:g}s"
            ) from exc
        except OSError as exc:
            raise PeerLostError(
                f"MPI connect to {peer_key} at {address} failed ({exc}); is the peer running?"
            ) from exc
        connecting: asyncio.Future[Any] | None = None
        try:
            writer.write(_frame(_HELLO, self.key.encode()))
            await writer.drain()
            raw_key, raw_port = await asyncio.wait_for(_read_frame(reader, _ACK), remaining())
            got = raw_key.decode()
            if got != peer_key:
                raise PeerLostError(
                    f"MPI: {address} is {got}, not {peer_key} (the peer restarted or the "
                    "address was reused)"
                )
            port_name = raw_port.decode()
            connecting = _in_thread(lambda: MPI.COMM_SELF.Connect(port_name), "kvxferd-mpi-connect")
            done, _ = await asyncio.wait({connecting}, timeout=remaining())
            if not done:
                raise asyncio.TimeoutError()
            comm = connecting.result()
            connecting = None
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            try:
                await asyncio.wait_for(_read_frame(reader, _READY), remaining())
            except BaseException:
                with contextlib.suppress(Exception):
                    comm.Free()
                raise
        except BaseException as exc:
            writer.close()
            if connecting is not None:
                # Finishes later (MPICH bounds it): free what it makes.
                connecting.add_done_callback(_free_comm)
            if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
                raise TransferTimeoutError(
                    f"MPI connect to {peer_key} at {address}: no rendezvous within {timeout_s:g}s"
                ) from exc
            if isinstance(exc, asyncio.IncompleteReadError | ConnectionError):
                raise PeerLostError(
                    f"MPI connect to {peer_key} at {address}: the peer closed the rendezvous"
                ) from exc
            if isinstance(exc, Exception) and not isinstance(exc, TransferError):
                raise TransferError(
                    f"MPI connect to {peer_key} at {address} failed ({type(exc).__name__}: {exc})"
                ) from exc
            raise
        if self._closed:
            writer.close()
            with contextlib.suppress(Exception):
                comm.Free()
            raise TransferError(f"MPI transport {self.key} is closed")
        self._register(peer_key, comm, reader, writer, rt)

    # -- peers ---------------------------------------------------------------

    def _register(
        self,
        key: str,
        comm: Any,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        rt: _Runtime,
    ) -> None:
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = _Peer(key)
        # Lost links stay only while headers that came over them wait for a recv.
        waiting = {id(entry[0]) for queue in peer.pending.values() for entry in queue}
        peer.links = [x for x in peer.links if x.lost is None or id(x) in waiting]
        link = _Link(comm, writer, rt.tag_ub)
        peer.links.append(link)
        link.watcher = asyncio.ensure_future(self._watch(peer, link, reader))
        self._start_ticker()

    async def _watch(self, peer: _Peer, link: _Link, reader: asyncio.StreamReader) -> None:
        """The TCP connection's end is the link's end (the peer died, or closed it)."""
        try:
            data = await reader.read(1)
            reason = (
                "the peer sent data on the MPI rendezvous connection"
                if data
                else "the peer closed the connection (exited, died, or removed us)"
            )
        except (ConnectionError, OSError) as exc:
            reason = f"the connection to the peer failed ({exc})"
        except asyncio.CancelledError:
            return
        if link.lost is None:
            link.lost = reason
            log.info("MPI: link to %s lost: %s", peer.key, reason)
        link.writer.close()

    def _drop_links(self, peer: _Peer, reason: str, writer: Any = None) -> None:
        for link in peer.links:
            if writer is not None and link.writer is not writer:
                continue
            if link.lost is None:
                link.lost = reason
            link.writer.close()  # tells the peer
            if link.watcher is not None:
                link.watcher.cancel()
            if link.header_req is not None:
                # Unmatched: cancelled at once. Matched: its header lands in our
                # own buffer; either way nobody waits for it.
                with contextlib.suppress(Exception):
                    link.header_req.Cancel()

    def _peer(self, peer_key: str) -> _Peer:
        peer = self._peers.get(peer_key)
        if peer is None:
            raise PeerLostError(
                f"MPI: no link to peer {peer_key}: it never connected (or its rendezvous "
                "has not finished yet), or it was removed"
            )
        return peer

    async def remove_peer(self, peer_key: str) -> None:
        """Close every link of that peer; its pending sends and receives fail."""
        peer = self._peers.pop(peer_key, None)
        if peer is not None:
            self._drop_links(peer, "the peer was removed")
        for key in [k for k in self._abandoned if k[0] == peer_key]:
            del self._abandoned[key]
        await asyncio.sleep(0)

    def peers(self) -> list[str]:
        """Keys of the peers with at least one live link."""
        return [k for k, p in self._peers.items() if p.live_link() is not None]

    # -- data ----------------------------------------------------------------

    def _mpi_error(self, exc: BaseException, peer: _Peer, link: _Link, what: str) -> TransferError:
        if isinstance(exc, TransferError):
            return exc
        if link.lost is not None or self._peers.get(peer.key) is not peer:
            return PeerLostError(f"MPI {what} with peer {peer.key}: peer lost ({exc})")
        return TransferError(f"MPI {what} with peer {peer.key} failed ({exc})")

    async def send(self, peer_key: str, tag: int, data: memoryview) -> None:
        """Send `data` (a contiguous host buffer) with `tag`; returns once MPI is done with it.

        A large message completes only when the receiver takes it. See the
        module docstring for what happens when it must give up first.
        """
        if not 0 <= tag < 1 << 64:
            raise ValueError(f"tag {tag} is not a 64-bit unsigned integer")
        rt = await self._runtime()
        MPI = rt.MPI
        peer = self._peer(peer_key)
        link = peer.live_link()
        if link is None:
            raise PeerLostError(
                f"MPI: the link to peer {peer_key} is closed ({peer.lost_reason()})"
            )
        payload = _flat(data, "send")
        data_tag = link.next_tag()
        header = _HEADER.pack(_HEADER_MAGIC, tag, payload.nbytes, data_tag)
        what = f"send of tag {tag}"
        reqs: list[Any] = []
        try:
            reqs.append(link.comm.Isend([header, MPI.BYTE], 0, _HEADER_TAG))
            reqs.append(link.comm.Isend([payload, MPI.BYTE], 0, data_tag))
        except Exception as exc:
            self._park(reqs, [header, payload], peer, link)
            raise self._mpi_error(exc, peer, link, what) from exc
        loop = asyncio.get_running_loop()
        spin_until = loop.time() + _PAYLOAD_SPIN_S
        try:
            while True:
                try:
                    if MPI.Request.Testall(reqs):
                        return
                except Exception as exc:
                    self._park(reqs, [header, payload], peer, link)
                    raise self._mpi_error(exc, peer, link, what) from exc
                if link.lost is not None or self._peers.get(peer_key) is not peer:
                    self._park(reqs, [header, payload], peer, link)
                    raise PeerLostError(
                        f"MPI {what} to {peer_key}: peer lost ({link.lost or 'removed'})"
                    )
                # MPI moves the bytes only while we call in: spin while it may.
                await asyncio.sleep(0.0 if loop.time() < spin_until else _POLL_MAX_SLEEP_S)
        except asyncio.CancelledError:
            await self._quiesce_send(reqs, [header, payload], peer, link)
            raise

    async def _quiesce_send(
        self, reqs: list[Any], bufs: list[object], peer: _Peer, link: _Link
    ) -> None:
        """The task in send was cancelled: give MPI `stall_grace_s` to finish with
        the buffer, then close the link (the peer fails its receive)."""
        MPI = self._rt.MPI if self._rt else None
        loop = asyncio.get_running_loop()
        limit = loop.time() + self._stall_grace_s
        while loop.time() < limit and link.lost is None:
            try:
                if MPI is None or MPI.Request.Testall(reqs):
                    return
            except Exception:
                break
            try:
                await asyncio.sleep(_POLL_MAX_SLEEP_S)
            except asyncio.CancelledError:
                continue
        log.warning(
            "MPI: a send to %s was cancelled and not done %.1fs later; closing the link",
            peer.key,
            self._stall_grace_s,
        )
        self._drop_links(peer, "a cancelled send did not finish", link.writer)
        self._park(reqs, bufs, peer, link)

    async def recv(self, peer_key: str, tag: int, out: memoryview, timeout_s: float | None) -> int:
        """Receive the message with `tag` from that peer into `out`; returns its size.

        `timeout_s` (None: unbounded) bounds the wait for the message to arrive;
        on expiry TransferTimeoutError. Nothing is written into `out` except by
        a recv that returns its size (the module docstring says how).
        """
        if out.readonly:
            raise TransferError("MPI recv needs a writable buffer")
        target = _flat(out, "recv")
        rt = await self._runtime()
        peer = self._peer(peer_key)
        key = (peer_key, tag)
        if key in self._receiving:
            # Both would wait for the one message.
            raise TransferError(f"MPI: tag {tag} from {peer_key} is already being received")
        self._receiving.add(key)
        try:
            return await self._recv(rt, peer, tag, target, timeout_s)
        finally:
            self._receiving.discard(key)

    async def _recv(
        self, rt: _Runtime, peer: _Peer, tag: int, out: memoryview, timeout_s: float | None
    ) -> int:
        MPI = rt.MPI
        self._abandoned.pop((peer.key, tag), None)
        loop = asyncio.get_running_loop()
        deadline = math.inf if timeout_s is None else loop.time() + timeout_s
        spins = 0
        while True:
            if self._peers.get(peer.key) is not peer:
                raise PeerLostError(f"MPI recv of tag {tag} from {peer.key}: peer removed")
            self._pump(peer, rt)
            queue = peer.pending.get(tag)
            if queue:
                break
            # After the headers: what a peer sent before it died is still received.
            if peer.live_link() is None:
                raise PeerLostError(
                    f"MPI recv of tag {tag} from {peer.key}: peer lost ({peer.lost_reason()})"
                )
            now = loop.time()
            if now >= deadline:
                self._abandon(peer.key, tag)
                raise TransferTimeoutError(
                    f"MPI recv of tag {tag} from {peer.key}: nothing within {timeout_s:g}s"
                )
            spins += 1
            delay = 0.0 if spins < _POLL_SPINS else _POLL_MAX_SLEEP_S
            await asyncio.sleep(min(delay, deadline - now))
        link, nbytes, data_tag = queue[0]
        if nbytes > out.nbytes:
            # Left queued for a recv with a buffer large enough.
            raise TransferError(
                f"MPI recv of tag {tag} from {peer.key}: the message has {nbytes} bytes, "
                f"the buffer only {out.nbytes}"
            )
        queue.popleft()
        if not queue:
            del peer.pending[tag]
        scratch = self._scratch.take(nbytes)
        what = f"recv of tag {tag}"
        try:
            req = link.comm.Irecv([scratch, nbytes, MPI.BYTE], 0, data_tag)
        except Exception as exc:
            self._scratch.give(scratch)
            raise self._mpi_error(exc, peer, link, what) from exc
        limit = (
            math.inf if deadline == math.inf else max(deadline, loop.time()) + self._stall_grace_s
        )
        status = MPI.Status()
        spin_until = loop.time() + _PAYLOAD_SPIN_S
        lost_at: float | None = None
        try:
            while True:
                try:
                    if req.Test(status):
                        break
                except Exception as exc:
                    self._park([req], scratch, peer, link)
                    raise self._mpi_error(exc, peer, link, what) from exc
                removed = self._peers.get(peer.key) is not peer
                if link.lost is not None and lost_at is None and not removed:
                    # What the peer sent before it went (or closed right after
                    # its send returned) may still be here: a moment to take it.
                    lost_at = loop.time()
                if removed or (lost_at is not None and loop.time() - lost_at > _LOST_GRACE_S):
                    self._park([req], scratch, peer, link)
                    raise PeerLostError(
                        f"MPI {what} from {peer.key}: peer lost mid-message "
                        f"({link.lost or 'removed'})"
                    )
                if loop.time() > limit:
                    self._drop_links(peer, "a message stalled", link.writer)
                    self._park([req], scratch, peer, link)
                    raise PeerLostError(
                        f"MPI {what} from {peer.key}: stalled mid-message "
                        f"{self._stall_grace_s:g}s past the deadline; link closed"
                    )
                # The payload is on its way: MPI moves it only while we call in.
                await asyncio.sleep(0.0 if loop.time() < spin_until else _POLL_MAX_SLEEP_S)
        except asyncio.CancelledError:
            # MPI may still write into scratch, never into `out`.
            self._park([req], scratch, peer, link)
            raise
        got = int(status.Get_count(MPI.BYTE))
        out[:got] = scratch[:got].data
        self._scratch.give(scratch)
        return got

    def _pump(self, peer: _Peer, rt: _Runtime) -> None:
        """Read the headers that arrived from the peer into its pending table."""
        for link in peer.links:
            while True:
                try:
                    if link.header_req is None:
                        if link.lost is not None:
                            break
                        link.header_req = link.comm.Irecv(
                            [link.header_buf, rt.MPI.BYTE], 0, _HEADER_TAG
                        )
                    if not link.header_req.Test():
                        break
                except Exception as exc:
                    if link.lost is None:
                        link.lost = f"MPI error reading a header ({exc})"
                        link.writer.close()
                    link.header_req = None
                    break
                link.header_req = None
                magic, tag, nbytes, data_tag = _HEADER.unpack(link.header_buf)
                if magic != _HEADER_MAGIC:
                    log.error("MPI: peer %s sent a malformed header; closing the link", peer.key)
                    self._drop_links(peer, "malformed message header", link.writer)
                    break
                if self._abandoned.pop((peer.key, tag), None) is not None:
                    self._drop_late(peer, link, tag, nbytes, data_tag, rt)
                else:
                    peer.pending.setdefault(tag, deque()).append((link, nbytes, data_tag))

    # -- late messages and abandoned requests -------------------------------

    def _park(self, reqs: list[Any], buf: object, peer: _Peer, link: _Link) -> None:
        """Keep requests (and their buffer) until MPI is done with them."""
        for req in reqs:
            with contextlib.suppress(Exception):
                req.Cancel()  # takes effect for a receive that has not matched yet
            self._zombies.append(_Zombie(req, buf, peer.key, link))
        self._start_ticker()

    def _drop_late(
        self, peer: _Peer, link: _Link, tag: int, nbytes: int, data_tag: int, rt: _Runtime
    ) -> None:
        scratch = np.empty(max(nbytes, 1), dtype=np.uint8)
        try:
            req = link.comm.Irecv([scratch, nbytes, rt.MPI.BYTE], 0, data_tag)
        except Exception as exc:
            log.debug("MPI: could not drain a late message from %s: %s", peer.key, exc)
            return
        self._zombies.append(_Zombie(req, scratch, peer.key, link))
        self._start_ticker()
        log.info(
            "MPI: dropped a late %d-byte message with tag %d from %s (its recv had timed out)",
            nbytes,
            tag,
            peer.key,
        )

    def _abandon(self, peer_key: str, tag: int) -> None:
        self._abandoned[(peer_key, tag)] = time.monotonic() + self._abandon_ttl_s
        self._start_ticker()

    def _start_ticker(self) -> None:
        if not self._closed and (self._ticker is None or self._ticker.done()):
            self._ticker = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        """Keep MPI moving while links exist (the ofi netmod sends and acknowledges
        only inside MPI calls), read headers, drain late messages of abandoned
        tags, and forget requests MPI is done with."""
        while not self._closed:
            rt = self._rt
            assert rt is not None
            now = time.monotonic()
            for key, expires in list(self._abandoned.items()):
                if now > expires:
                    self._abandoned.pop(key, None)
            live = False
            for peer in list(self._peers.values()):
                self._pump(peer, rt)
                live = live or peer.live_link() is not None
            waiting = False  # on a request that may still end
            for z in list(self._zombies):
                try:
                    finished = z.req.Test()
                except Exception:
                    finished = True
                if finished:
                    self._zombies.remove(z)
                elif z.link.lost is None or now - z.since < 1.0:
                    waiting = True
            if live or waiting or self._abandoned:
                await asyncio.sleep(_TICK_S)
            elif self._zombies:
                # Only receives from peers that are gone, which may never end.
                await asyncio.sleep(_STUCK_PERIOD_S)
            else:
                return

    # -- teardown ------------------------------------------------------------

    async def close(self) -> None:
        """Stop listening and close every link. MPI itself stays up for the process."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._handshakes):
            task.cancel()
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for key in list(self._peers):
            self._drop_links(self._peers.pop(key), "transport closed")
        self._abandoned.clear()
        await asyncio.sleep(0)


def _free_comm(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        with contextlib.suppress(Exception):
            fut.result().Free()

"""One MPI_Comm_accept, bounded without the event loop, and the release of an abandoned
one (the rendezvous listener, link.py; who gets to accept: accept_turns.py).

A stranger that takes the port and neither connects nor closes: see PendingAccept,
which ends such an accept after ACCEPT_WINDOW_S without the event loop (which the
accept stops: quiet.py). A released accept's port is retired, never closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from kvxferd.backends.mpi.bootstrap import Runtime, find_mpiexec
from kvxferd.backends.mpi.quiet import ACCEPTS
from kvxferd.errors import TransferError

log = logging.getLogger("kvxferd.backends.mpi")

# How long a listener's accept waits for the peer's MPI_Comm_connect once the peer has the
# port (a peer connects at once: ~10 ms here). The process's MPI work waits as long
# (quiet.py), so this stays under keepalive.STALL_S: no peer sees this daemon stalled.
ACCEPT_WINDOW_S = 3.0
# The throwaway process that releases an accept is given this long; then, once it ended,
# the accept this long to be seen completed before the turn is handed on regardless.
_RELEASER_TIMEOUT_S = 120.0
_SETTLE_S = 5.0

# Run (under mpiexec when there is one) to end an MPI_Comm_accept whose peer
# never connected: connecting completes it. Exits without MPI_Finalize, so it
# unlinks the /dev/shm file its MPI_Init made (a world of one), as the daemon
# does; each release left 1 MiB there before.
_ACCEPT_RELEASER = """
import sys, mpi4py
mpi4py.rc.finalize = False
from mpi4py import MPI
try:  # tidiness only: the Connect must happen whatever this does
    from kvxferd.backends.mpi.bootstrap import unlink_world_shm
    if MPI.COMM_WORLD.Get_size() == 1:
        unlink_world_shm()
except Exception:
    pass
MPI.COMM_SELF.Connect(sys.argv[1])
"""


class PendingAccept:
    """One MPI_Comm_accept on `port`, in its own thread, bounded without the event loop.

    While an accept waits, every other MPI call of the process blocks (quiet.py): the
    listener's own timeout ran on the event loop, so a stranger that took the port and
    neither connected nor closed stopped the daemon for good. A timer thread now
    releases the accept `window_s` after it began; `release()` does it at once (the
    peer closed its side). `future` (settled on the loop) gives the intercommunicator,
    or None when the accept was released: the releasing process made it, and it is
    freed here. Made on the event loop, which counts it in ACCEPTS until its thread
    ends.

    A port whose accept was released is retired, not closed: MPICH hands the same name
    to the next MPI_Open_port, and a connect that came late to it (the real peer's, or
    the releasing process's when the real peer won) stayed queued there and matched the
    next accept on that name, or crashed it (SIGSEGV). A retired port takes no accept
    again; its late connects end at MPICH's connect timeout.
    """

    def __init__(self, rt: Runtime, port: str, window_s: float) -> None:
        self._rt = rt
        self.port = port
        self._loop = asyncio.get_running_loop()
        self.future: asyncio.Future[Any] = self._loop.create_future()
        self._lock = threading.Lock()
        self._ended = False
        self._released = False
        self._timer = threading.Timer(window_s, self.release)
        self._timer.daemon = True
        ACCEPTS.enter()
        try:
            threading.Thread(target=self._accept, name="kvxferd-mpi-accept", daemon=True).start()
        except BaseException:
            ACCEPTS.leave()
            raise
        try:
            self._timer.start()
        except RuntimeError as exc:  # no thread for the window: released at once
            log.error("MPI: no timer for an MPI_Comm_accept's window (%s): releasing it", exc)
            self.release()

    def _accept(self) -> None:
        comm: Any = None
        error: BaseException | None = None
        try:
            comm = self._rt.MPI.COMM_SELF.Accept(self.port)
        except BaseException as exc:
            error = exc
        finally:
            with self._lock:
                self._ended = True
                released = self._released
            self._timer.cancel()
            if released and comm is not None:
                with contextlib.suppress(Exception):
                    comm.Free()
                comm = None
            with contextlib.suppress(RuntimeError):  # the loop is gone
                self._loop.call_soon_threadsafe(self._settle, comm, error)

    def _settle(self, comm: Any, error: BaseException | None) -> None:
        ACCEPTS.leave()
        if self._released or error is not None:
            # An accept that failed may have a connect queued on its port as well.
            _retire(self.port)
        else:
            with contextlib.suppress(Exception):
                self._rt.MPI.Close_port(self.port)
        if self.future.done():  # given up (the release failed): nobody takes it
            if comm is not None:
                with contextlib.suppress(Exception):
                    comm.Free()
        elif error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(comm)

    def release(self) -> None:
        """End the accept now if it still waits (any thread; once)."""
        with self._lock:
            if self._ended or self._released:
                return
            self._released = True
        try:
            _run_releaser(self._rt, self.port, self._given_up)
        except Exception as exc:  # no thread: the accept spins on
            log.error("MPI: could not start the release of an MPI_Comm_accept: %s", exc)
            self._given_up()

    def _given_up(self) -> None:
        # The releasing process ended; the accept's thread settles a moment after the
        # Connect. If it has not by _SETTLE_S, the release failed: the turn goes on (the
        # next accept still waits for this one in ACCEPTS, and says why in the log).
        def check() -> None:
            if not self.future.done():
                log.error(
                    "MPI: an abandoned MPI_Comm_accept could not be released; it spins "
                    "on, and the process's MPI calls wait behind it"
                )
                self.future.set_exception(TransferError("the MPI accept could not be released"))

        with contextlib.suppress(RuntimeError):  # the loop is gone
            self._loop.call_soon_threadsafe(self._loop.call_later, _SETTLE_S, check)


# Ports retired (above). MPICH hands out the lowest free name, so closing the oldest
# retired port made its name the next one again, with its late connect still queued: the
# crash came back after 64 (reproduced with the cap at 1). They are never closed; MPICH
# allows a process 2048 open ports, and past _RETIRED_MAX the listener takes no new
# rendezvous (RETIRED_FULL) until the daemon restarts.
_retired: list[str] = []
_RETIRED_MAX = 1536
RETIRED_FULL = (
    f"{_RETIRED_MAX} MPI ports were retired after abandoned rendezvous; no more are opened "
    "until this daemon restarts (firewall the MPI rendezvous port: docs/operations.md)"
)


def retired_full() -> bool:
    return len(_retired) >= _RETIRED_MAX


def _retire(port: str) -> None:
    if not _retired:
        log.warning(
            "MPI: a rendezvous was abandoned; its port is retired, not closed (at most "
            "%d, then no new MPI links until restart)",
            _RETIRED_MAX,
        )
    _retired.append(port)
    if retired_full():
        log.error("MPI: %s", RETIRED_FULL)


def _run_releaser(rt: Runtime, port: str, ended: Callable[[], None]) -> None:
    """Connect a throwaway process to `port`, which completes the accept waiting on it
    (MPI has no way to cancel one); `ended` is called in its thread once the process
    ended, however."""
    mpiexec = find_mpiexec()
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
                timeout=_RELEASER_TIMEOUT_S,
                start_new_session=True,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("MPI: could not release an abandoned MPI_Comm_accept: %s", exc)
        ended()

    log.info("MPI: releasing an MPI_Comm_accept whose peer went away")
    threading.Thread(target=run, name="kvxferd-mpi-release", daemon=True).start()

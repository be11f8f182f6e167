"""The process's MPI: bootstrapped and initialised once, never finalised.

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

Before MPI_Init this also sets MPICH's and UCX's defaults (unless set
already, ucx_env.py): see "Surviving a peer's death" in the package docstring. And since
MPI_Finalize never runs, it unlinks the /dev/shm file MPICH made at MPI_Init.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvxferd.backends.mpi import ucx_env
from kvxferd.errors import BackendUnavailableError, StartupError

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
# thread whose peer vanished mid-handshake ends instead of waiting 180 s. Shorter
# than the rendezvous timeouts of the callers (10 s and more), which hand the connect
# turn on when they give up: with 30, a connect to a listener stopped just after it
# handed out its port ran on for 20 s beside the next one, and MPICH may take the
# process down when two connects overlap. A live listener accepts before it hands out
# the port, and is reached in ~10 ms.
_CONNECT_TIMEOUT_CVAR = "MPIR_CVAR_CH4_COMM_CONNECT_TIMEOUT"
_CONNECT_TIMEOUT_DEFAULT = "4"
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


def load_mpi4py() -> Any:
    """The mpi4py package, or BackendUnavailableError saying what to install."""
    try:
        # importlib keeps the untyped package out of mypy's sight. This imports
        # only the package: MPI itself loads and initialises on first use.
        return importlib.import_module("mpi4py")
    except (ImportError, OSError) as exc:
        raise BackendUnavailableError(
            f"backend MPI needs the mpi4py package, which does not import ({exc}); " + _INSTALL_HINT
        ) from exc


@dataclass
class Runtime:
    MPI: Any
    tag_ub: int
    mode: str  # "process manager", "bootstrapped" or "singleton"
    # The bootstrap helper: its mpiexec and our end of its Unix socket.
    helper: subprocess.Popen[bytes] | None = None
    helper_conn: socket.socket | None = None


_process_lock = threading.Lock()
_process_rt: Runtime | None = None


def process_runtime() -> Runtime | None:
    """The process's MPI if it is initialised already (by init_runtime), else None."""
    return _process_rt


def find_mpiexec() -> str | None:
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


def unlink_world_shm() -> None:
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


def init_runtime() -> Runtime:
    """Bootstrap (if needed) and initialise the process's MPI, once; blocks."""
    mpi4py = load_mpi4py()
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
            mpiexec = find_mpiexec()
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
            ucx_env.apply_defaults(os.environ)
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
            unlink_world_shm()  # no other local rank of our world will attach
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            raise StartupError(
                f"MPI provides thread level {provided}, the MPI backend needs "
                "MPI_THREAD_MULTIPLE (accept and connect run in threads)"
            )
        for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):
            comm.Set_errhandler(MPI.ERRORS_RETURN)
        tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
        _process_rt = Runtime(
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
            os.environ.get(ucx_env.NETMOD_CVAR, "MPICH's default"),
            os.environ.get("UCX_TLS", "UCX's default"),
            tag_ub,
        )
        hazard = ucx_env.shared_memory_hazard(os.environ)
        if hazard is not None:
            log.warning(hazard)
        return _process_rt

"""Whether UCX in this process writes to peers on this kernel with CMA, and so whether a
cancelled write to such a peer is over when its handle is released.

Between two processes of one kernel UCX moves a one-sided put in one of two ways. With
CMA (cross-memory attach, process_vm_writev) the writer's own process copies into the
receiver's memory: a write into a stopped receiver completes, and a released handle leaves
nothing behind. Without CMA (UCX_TLS leaving it out, Yama's ptrace_scope refusing it, or a
seccomp filter refusing process_vm_writev: UCX checks the last two and turns CMA off) a put
travels as messages, through UCX's shared-memory queues or its TCP sockets, that the
receiver's UCX copies into place when it runs: after the sender released the handle, a
stopped receiver that resumes still lands those bytes (seen over TCP:
tests/daemon/test_faults.py, a receiver stopped mid-write). Such a write must be drained
like one to another host (transceiver/tx_drains.py).

Both ends must offer CMA for UCX to use it, so each daemon announces its own
(Info.ucx_cma) and a sender cancels at once only when both do. Whether UCX leaves CMA out
(UCX_TLS, UCX_SHM_DEVICES, UCX_MODULES, from the environment or a ucx.conf) is asked of
the backend's own UCX copy (backends/ucx_config.py); one that cannot say counts as no.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from functools import cache

from kvxferd.backends import ucx_config

log = logging.getLogger("kvxferd.backends")

# Backends whose one-sided writes UCX moves (NIXL through its UCX plugin).
UCX_BACKENDS = frozenset({"NIXL", "UCX"})
PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
# UCX_TLS names that include CMA: its own and the shared-memory aliases (and "all").
_WITH_CMA = frozenset({"cma", "sm", "shm"})


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def tls_names(tls: str, *, wireup: bool = True) -> set[str]:
    """The transport names in a UCX_TLS list (without its leading "^"), lower case.
    "tcp:aux" names a transport used only for wire-up: counted unless `wireup` is False
    (asking which transports may carry the data)."""
    names = set()
    for entry in tls.split(","):
        name, _, kind = entry.strip().lower().partition(":")
        if name and (wireup or kind != "aux"):
            names.add(name)
    return names


def _keeps(value: str, wanted: frozenset[str] | set[str], *, wireup: bool = True) -> bool:
    """Whether a UCX list setting (names, or "^" and the names it leaves out) keeps one of
    `wanted` ("all" keeps, or leaves out, everything). `wireup`: as tls_names'."""
    value = value.strip().lower()
    if value.startswith("^"):
        return not (tls_names(value[1:]) & (wanted | {"all"}))
    return bool(tls_names(value, wireup=wireup) & (wanted | {"all"}))


def tls_allows_cma(tls: str | None) -> bool:
    """Whether UCX_TLS = `tls` (None or empty: UCX's default, every transport) lets UCX use
    CMA."""
    if tls is None or not tls.strip():
        return True
    return _keeps(tls, _WITH_CMA, wireup=False)


def ptrace_allows_cma(path: str = PTRACE_SCOPE) -> bool:
    """Whether Yama lets UCX use CMA: scope 0 yes; 1 yes (UCX declares any process its
    ptracer); 2 and 3 taken as no."""
    try:
        with open(path, encoding="ascii") as f:
            scope = f.read().strip()
    except FileNotFoundError:
        return True  # no Yama: process_vm_writev needs only the same user
    except OSError:
        return False  # unknown: say no, which costs only a drain
    # Scope 2 (CAP_SYS_PTRACE only): UCX builds without capability support, and older
    # UCX, turn CMA off there, and one UCX's test of the capability is unreliable; "no"
    # costs only a drain, a wrong "yes" a cancelled write that may still land.
    return scope in ("0", "1")


def writev_works() -> bool:
    """Whether process_vm_writev works here at all (a seccomp filter may refuse it): UCX
    tries it on its own process before offering CMA, and so does this."""
    libc = ctypes.CDLL(None, use_errno=True)
    src, dst = ctypes.c_uint64(1), ctypes.c_uint64(0)
    local = _IoVec(ctypes.cast(ctypes.pointer(src), ctypes.c_void_p), 8)
    remote = _IoVec(ctypes.cast(ctypes.pointer(dst), ctypes.c_void_p), 8)
    try:
        fn = libc.process_vm_writev
    except AttributeError:
        return False
    fn.restype = ctypes.c_ssize_t
    iov = ctypes.POINTER(_IoVec)
    fn.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong]
    done = fn(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return bool(done == 8 and dst.value == 1)


def devices_allow_cma(devices: str) -> bool:
    """Whether UCX_SHM_DEVICES = `devices` keeps CMA's device ("memory")."""
    return _keeps(devices, {"memory"})


def modules_allow_cma(modules: str) -> bool:
    """Whether UCX_MODULES = `modules` loads UCX's cma module."""
    return _keeps(modules, {"cma"})


def settings_allow_cma(settings: ucx_config.Settings | None) -> bool:
    """Whether a UCX copy with these settings (None: it could not say) may use CMA."""
    return (
        settings is not None
        and tls_allows_cma(settings["TLS"])
        and devices_allow_cma(settings["SHM_DEVICES"])
        and modules_allow_cma(settings["MODULES"])
    )


def cma_writes(
    backend: str,
    settings: Callable[[str], list[ucx_config.Settings | None]] = ucx_config.backend_settings,
) -> bool:
    """Whether `backend`'s writes to and from peers on this kernel may go by CMA here:
    every UCX copy it may load keeps CMA (`settings`: theirs, asked of UCX by default)."""
    if backend not in UCX_BACKENDS or not ptrace_allows_cma() or not writev_works():
        return False
    copies = settings(backend)
    if not copies:
        log.warning(
            "found no UCX library of the %s backend to ask whether it uses CMA; writes to "
            "peers on this host that end in flight are drained, not cancelled",
            backend,
        )
        return False
    return all(settings_allow_cma(each) for each in copies)


@cache
def cma_writes_here(backend: str) -> bool:
    """cma_writes for this process's environment (read once: it does not change)."""
    return cma_writes(backend)

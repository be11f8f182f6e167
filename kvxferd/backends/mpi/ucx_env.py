"""The environment MPICH's ucx netmod starts with, and what it implies.

Set before MPI_Init, unless the operator set it already (docs/backends-mpi.md, "Peer
death" and "A peer stopped or killed inside a shared-memory send"):

* UCX's transports: every one but CMA, whose failed read of a dead peer aborts the
  receiver. On one host that leaves UCX's shared memory (posix/sysv "mm").
* 1 MiB TCP segments, where UCX uses TCP.
* When UCX_TLS leaves out shared memory (an operator who chose TCP), MPICH's pack
  buffers large enough for one TCP segment: MPI_Init otherwise aborts on MPICH's
  assertion `MPIR_CVAR_CH4_PACK_BUFFER_SIZE >= buf_size_limit` (measured with MPICH
  5.0.2 and its UCX 1.20.1, UCX_TLS=tcp: aborted; with 2 MiB pack buffers: started).

UCX's shared memory has a hazard of its own: all the peers on one host that send to a
process put their messages in one receive queue of that process, in order. A sender
claims its slot, copies the message in, then marks it written; a sender stopped or
killed between the two leaves a slot the receiver waits on before every later one.
`shared_memory_tls` tells whether that hazard applies, so that the daemon can say so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping

from kvxferd.backends.cma import tls_names

NETMOD_CVAR = "MPIR_CVAR_CH4_NETMOD"
DEFAULT_NETMOD = "ucx"
PACK_BUFFER_CVAR = "MPIR_CVAR_CH4_PACK_BUFFER_SIZE"

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

# UCX_TLS names that are (or include) the shared-memory transports built on one receive
# queue per process: posix and sysv (and xpmem, where built), together "mm"; "sm" and
# "shm" name every shared-memory transport.
_SHM_GROUPS = frozenset({"sm", "shm", "mm"})
_SHM_TRANSPORTS = frozenset({"posix", "sysv", "xpmem"})
# Enough to exclude the queue where xpmem is not built (the mpich wheel's UCX has not).
_SHM_BUILT = frozenset({"posix", "sysv"})

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$")


def shared_memory_tls(tls: str | None) -> bool:
    """Whether UCX_TLS = `tls` (None or empty: UCX's default, every transport) lets UCX carry
    messages between processes of one host through its shared-memory receive queues."""
    if tls is None or not tls.strip():
        return True
    value = tls.strip()
    if value.startswith("^"):
        excluded = tls_names(value[1:])
        return not (excluded & _SHM_GROUPS or excluded >= _SHM_BUILT)
    named = tls_names(value)
    return bool(named & (_SHM_GROUPS | _SHM_TRANSPORTS | {"all"}))


def size_bytes(text: str | None) -> int | None:
    """A UCX size ("1M", "64k", "8192"), or None when absent or not one."""
    if text is None:
        return None
    m = _SIZE_RE.match(text.lower())
    if m is None or m.group(2) not in _UNITS:
        return None
    return int(m.group(1)) * _UNITS[m.group(2)]


def pack_buffer_bytes(env: Mapping[str, str]) -> int | None:
    """MPICH's pack buffer size to set for `env` (UCX's variables already defaulted), or
    None to leave MPICH's own: only where UCX_TLS leaves out shared memory, so that TCP's
    segments carry the active messages (twice the larger segment, at least 2 MiB)."""
    if PACK_BUFFER_CVAR in env or shared_memory_tls(env.get("UCX_TLS")):
        return None
    segments = [size_bytes(env.get(k)) for k in ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE")]
    largest = max((s for s in segments if s is not None), default=0)
    return max(2 << 20, 2 * largest)


def apply_defaults(env: MutableMapping[str, str]) -> None:
    """Set the netmod, UCX's defaults and (for TCP alone) the pack buffer size in `env`,
    leaving every variable already set as it is."""
    env.setdefault(NETMOD_CVAR, DEFAULT_NETMOD)
    for name, value in UCX_DEFAULTS.items():
        env.setdefault(name, value)
    pack = pack_buffer_bytes(env)
    if pack is not None:
        env[PACK_BUFFER_CVAR] = str(pack)


def shared_memory_hazard(env: Mapping[str, str]) -> str | None:
    """The warning a daemon gives when its MPI runs over UCX's shared memory, or None."""
    if env.get(NETMOD_CVAR, DEFAULT_NETMOD).lower() != "ucx":
        return None
    if not shared_memory_tls(env.get("UCX_TLS")):
        return None
    return (
        "MPI: peers on this host reach us through UCX's shared-memory receive queue "
        f"(UCX_TLS={env.get('UCX_TLS', '')!r}): a peer stopped (SIGSTOP) or killed inside "
        "a send holds up our MPI receives from every peer until it resumes, or until this "
        "daemon restarts if it was killed. Where peers can stall or die, run MPI without "
        "UCX's shared memory (UCX_TLS=^sm and UCX_NET_DEVICES naming a network device: TCP "
        "on one host, RDMA or TCP between hosts) or use another backend "
        "(docs/backends-mpi.md, 'A peer stopped or killed inside a shared-memory send')"
    )

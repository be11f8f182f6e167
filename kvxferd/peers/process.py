"""Which process a peer daemon is, and whether it still exists.

A receiver may hand blocks back after a failure only when no write into them can
still land. One proof is that the writing process is gone. A daemon tells its peers
(in its handshake Info, after authentication) its boot id, pid namespace, pid and
start time. When both daemons see the same kernel and pid namespace, the receiver can
watch the writer through a pidfd: it becomes readable when the process exits (a
zombie holds no memory mappings and can write nothing). A stopped (SIGSTOP) process
is not gone. Elsewhere, nothing here can prove a death.
"""

from __future__ import annotations

import contextlib
import os
import select
from dataclasses import dataclass
from functools import cache

import msgspec


class ProcessInfo(msgspec.Struct, frozen=True):
    """A daemon's process as it announces it; empty values mean unknown."""

    boot_id: str = ""
    pid_ns: str = ""
    pid: int = 0
    start: int = 0  # clock ticks after boot (/proc/PID/stat field 22)


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read()


def _parse_stat(raw: str) -> list[str] | None:
    """Fields 3.. of a /proc/PID/stat line (after the command name, which may hold
    spaces); None when there are not the 20 we read."""
    _, sep, rest = raw.rpartition(")")
    fields = rest.split() if sep else []
    return fields if len(fields) >= 20 else None


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return _parse_stat(_read(f"/proc/{pid}/stat"))
    except OSError:
        return None


@cache
def me() -> ProcessInfo:
    """This process (cached: none of it changes while we run)."""
    try:
        boot_id = _read("/proc/sys/kernel/random/boot_id").strip()
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ProcessInfo()
    fields = _stat_fields(os.getpid())
    start = int(fields[19]) if fields and len(fields) > 19 else 0
    return ProcessInfo(boot_id=boot_id, pid_ns=pid_ns, pid=os.getpid(), start=start)


def comparable(peer: ProcessInfo | None) -> bool:
    """True when `peer`'s pid means the same process here (same kernel, same pid namespace)."""
    mine = me()
    return (
        peer is not None
        and peer.pid > 0
        and peer.start > 0
        and bool(mine.boot_id)
        and peer.boot_id == mine.boot_id
        and peer.pid_ns == mine.pid_ns
    )


@dataclass
class ProcessWatch:
    """A pidfd on a peer's process, or the knowledge that it is already gone."""

    fd: int  # -1 when gone at opening

    @property
    def gone_at_open(self) -> bool:
        return self.fd < 0

    def exited_now(self) -> bool:
        """The pidfd is readable: its process has exited (a zombie holds no memory)."""
        if self.fd < 0:
            return True
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def alive(peer: ProcessInfo) -> bool | None:
    """Whether `peer` exists now: True, False (provably gone), or None (nothing can be
    proven here: another kernel or pid namespace, no pidfd, /proc unreadable)."""
    w = watch(peer)
    if w is None:
        return None
    gone = w.gone_at_open
    w.close()
    return not gone


def exited(peer: ProcessInfo) -> bool:
    """True when `peer` is provably gone now (False: alive, or nothing can be proven)."""
    return alive(peer) is False


def watch(peer: ProcessInfo) -> ProcessWatch | None:
    """Open a watch on `peer` (None: its pid means nothing here, so no death can be proven).

    The pidfd pins the pid number, so the start time read after opening tells whether
    the process behind it is still the one the peer announced.
    """
    if not comparable(peer):
        return None
    try:
        fd = os.pidfd_open(peer.pid)
    except ProcessLookupError:
        return ProcessWatch(-1)
    except (OSError, OverflowError, ValueError):
        return None  # no pidfd support, or a pid that cannot be one: cannot prove anything
    w = ProcessWatch(fd)
    if w.exited_now():
        w.close()
        return ProcessWatch(-1)  # whoever has the number now exited: so did the announced one
    try:
        fields = _parse_stat(_read(f"/proc/{peer.pid}/stat"))
    except OSError:
        # Exited since, or hidden or unreadable (/proc mounted hidepid, another uid):
        # only the pidfd can tell, and it cannot tell a reused number from the announced.
        gone = w.exited_now()
        w.close()
        return ProcessWatch(-1) if gone else None
    if fields is None:
        w.close()
        return None  # not a stat line we can read: proves nothing
    if int(fields[19]) != peer.start or fields[0] in ("Z", "X"):
        w.close()
        return ProcessWatch(-1)  # the announced process ended (its pid may be someone else's)
    return w

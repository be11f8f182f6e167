"""Large copies with non-temporal stores: glibc's threshold for them, set before the daemon
starts.

The staged runtime and the bounce buffer copy every byte into a staging region and out of
another (gather, scatter): MiB-sized streaming copies nothing reads again soon from this
core's cache. glibc's memcpy switches to non-temporal stores only above
`glibc.cpu.x86_non_temporal_threshold`, which it derives from the shared cache size the
CPU reports; on the 2-core EPYC VM these numbers come from, the hypervisor reports 320 MiB,
so the threshold is 240 MiB and no copy the daemon makes ever takes that path. Each 4 MiB
block then costs a read for ownership of its destination and pushes the other copies'
lines out of the 32 MiB L3. With the threshold at 1 MiB in the daemons, staged
NIXL moved 15 % more (4.37 against 3.81 GB/s) for 15 % less daemon CPU per GB (0.41
against 0.48 s/GB), 3 alternating passes; the PYTHON runtime, whose bytes NIXL copies in
the kernel, and staged MPI, whose shared-memory FIFO copies are small, did not move
(docs/benchmarks.md, issue 16 "the staged runtime", 2026-12-04).

glibc reads its tunables once, when the process starts, so the only way to set one for the
daemon is to start it again with GLIBC_TUNABLES set: `kvxferd run` re-executes itself once
(same pid, same arguments, same open descriptors) when the variable does not name the
threshold already. An operator's own value, for this tunable or any other, stands.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import Mapping

log = logging.getLogger("kvxferd.daemon")

TUNABLES_ENV = "GLIBC_TUNABLES"
NT_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
# Copies from 1 MiB up: a staged round's blocks (whole blocks of MiB, or a round of 16 MiB);
# the small copies of the request path stay in cache as glibc chose.
NT_THRESHOLD = 1 << 20
# Set in the re-executed process: it tells the daemon's log what happened, and stops a
# second re-execution if glibc dropped the variable (it does for set-user-ID programs).
REEXEC_MARK_ENV = "KVXFERD_NT_COPIES"


def nt_copies_env(environ: Mapping[str, str], machine: str, libc: str) -> dict[str, str] | None:
    """The environment to start the daemon again with, or None when it is fine as it is:
    not x86-64 glibc (the tunable does not exist there), the operator named the threshold
    already, or this process is the re-executed one."""
    if machine.lower() not in ("x86_64", "amd64") or libc != "glibc":
        return None
    if REEXEC_MARK_ENV in environ:
        return None
    tunables = environ.get(TUNABLES_ENV, "")
    if NT_TUNABLE in tunables:
        return None
    ours = f"{NT_TUNABLE}={NT_THRESHOLD:#x}"
    env = dict(environ)
    env[TUNABLES_ENV] = f"{tunables}:{ours}" if tunables else ours
    env[REEXEC_MARK_ENV] = ours
    return env


def _libc() -> str:
    """The C library's name as nt_copies_env takes it ("" when it is not glibc);
    platform.libc_ver() would read the interpreter's whole binary to say as much."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return ""  # not glibc: the name is unknown there
    return "glibc" if version.startswith("glibc") else ""


def reexec_with_nt_copies() -> None:
    """Start this process again with the threshold set, when nt_copies_env says so; returns
    only when it does not (or the exec failed, which is logged and harmless: the copies
    are then as glibc chose)."""
    env = nt_copies_env(os.environ, platform.machine(), _libc())
    if env is None:
        return
    # sys.orig_argv keeps the interpreter's own options and how it was started (a console
    # script, or `python -m kvxferd.cli`): the same command, again.
    argv = [sys.executable, *sys.orig_argv[1:]]
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, argv, env)
    except OSError as exc:
        log.warning(
            "could not restart with %s set (%s); copies stay as glibc chose", NT_TUNABLE, exc
        )


def log_nt_copies() -> None:
    """Once logging is set up: say that this process was restarted for the threshold."""
    ours = os.environ.get(REEXEC_MARK_ENV)
    if ours and ours in os.environ.get(TUNABLES_ENV, ""):
        log.info(
            "large copies use non-temporal stores: GLIBC_TUNABLES %s (set %s yourself to "
            "choose otherwise)",
            ours,
            NT_TUNABLE,
        )

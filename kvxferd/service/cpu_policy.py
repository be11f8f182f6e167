"""The daemon's CPU scheduling policy: SCHED_BATCH, so that its wake-ups do not preempt.

A daemon wakes for every engine call, peer message and completed write: at thousands of
small requests a second, each wake-up of a normal (SCHED_OTHER) task on a busy core
preempts whoever runs there, often the process that just wrote to it, in the middle of its
loop turn. The two then take turns a few frames at a time instead of each finishing its
batch. A SCHED_BATCH task gets the same share of the CPU (the policy changes no weight or
nice value) but does not preempt on wake-up: it runs when the current task sleeps or its
slice ends. With the two daemons on SCHED_BATCH, `kvxferd bench --small` moved 9.5 % more
one-block requests at 32 in flight (4 passes, ranges apart) for 10 % less daemon CPU each,
and the p50 at one in flight did not move (docs/benchmarks.md, issue 16 "the daemons on
SCHED_BATCH", 2026-12-06). For an engine on the same cores it is the better neighbour too:
the daemon's wake-ups no longer cut into the engine's slices.

Not for every transport: UCX and MPI move a staged round by messages the two daemons'
progress (UCX's on the event loop, MPI's on a thread) answers back and forth, and each
answer then waited for the running task's slice: staged UCX fell from 0.87x to 0.68x its
bare transport, staged MPI from 0.46x to 0.40x, while staged NIXL rose from 0.82x to 0.98x
and Mooncake from 0.96x to 1.10x (2 passes each, same passes). So `auto`, the default,
takes SCHED_BATCH with NIXL and Mooncake and leaves a UCX or MPI daemon as started.

Where the kernel has idle cores, a wake-up goes to one of them and the policy changes
nothing. An operator who chose a policy for the daemon (systemd's CPUSchedulingPolicy=,
chrt) keeps it: only a daemon started as SCHED_OTHER is moved; `daemon.cpu_policy: batch`
asks for SCHED_BATCH whatever the backend, and `inherit` leaves the daemon as started in
every case. Every thread of the process is moved (the ones started later inherit the
policy from the thread that starts them).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger("kvxferd.daemon")

CpuPolicyChoice = Literal["auto", "batch", "inherit"]
# The backends whose daemons gain from SCHED_BATCH (measured; see the module docstring).
BATCH_BACKENDS = ("NIXL", "MOONCAKE")

# Linux's policy numbers (sched.h), for the names os lacks on some builds.
_NAMES = {0: "other", 1: "fifo", 2: "rr", 3: "batch", 5: "idle", 6: "deadline"}
_SCHED_OTHER = 0
_SCHED_BATCH = 3


def policy_name(policy: int) -> str:
    """ "other", "batch", "fifo"... for a policy number (its number when unknown)."""
    return _NAMES.get(policy, str(policy))


def current_policy() -> str | None:
    """This thread's policy by name; None where the platform has no scheduling policies."""
    getter = getattr(os, "sched_getscheduler", None)
    if getter is None:
        return None
    try:
        return policy_name(getter(0))
    except OSError:
        return None


@dataclass(frozen=True)
class CpuPolicy:
    """What apply_cpu_policy did: the policy the daemon runs under (None: unknown) and a
    sentence for the log."""

    policy: str | None
    detail: str
    refused: bool = False  # the kernel refused SCHED_BATCH to some or all threads


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # no /proc: this thread (the others, if any, keep theirs)


def wants_batch(choice: CpuPolicyChoice, backend: str) -> bool:
    """Whether `choice` asks for SCHED_BATCH for a daemon of `backend` (auto: by backend)."""
    return choice == "batch" or (choice == "auto" and backend in BATCH_BACKENDS)


def apply_cpu_policy(choice: CpuPolicyChoice, backend: str) -> CpuPolicy:
    """Put every thread of this process on SCHED_BATCH when `choice` asks for it for
    `backend` (wants_batch), unless the process was started under another policy than
    SCHED_OTHER; otherwise change nothing. A refusal (a seccomp profile, a platform without
    the call) leaves the policy as it was."""
    setter = getattr(os, "sched_setscheduler", None)
    getter = getattr(os, "sched_getscheduler", None)
    if setter is None or getter is None:
        return CpuPolicy(None, "CPU scheduling policy left alone: not supported here")
    started = getter(0)
    if not wants_batch(choice, backend):
        why = (
            "inherit"
            if choice == "inherit"
            else f"auto, and the {backend} backend's transfers wait on the daemons' wake-ups"
        )
        return CpuPolicy(
            policy_name(started),
            f"CPU scheduling policy {policy_name(started)}, as started (daemon.cpu_policy: {why})",
        )
    if started != _SCHED_OTHER:
        return CpuPolicy(
            policy_name(started),
            f"CPU scheduling policy {policy_name(started)}, as started: the operator chose "
            f"it (daemon.cpu_policy: {choice} moves only a daemon started as other)",
        )
    param = os.sched_param(0)
    moved, refused = 0, ""
    for tid in _threads():
        try:
            setter(tid, _SCHED_BATCH, param)
            moved += 1
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as exc:
            refused = refused or f"{exc.strerror or exc} (thread {tid})"
    if refused and not moved:
        return CpuPolicy(
            "other",
            f"CPU scheduling policy left at other: SCHED_BATCH was refused: {refused}",
            refused=True,
        )
    now = policy_name(getter(0))
    detail = (
        f"CPU scheduling policy batch: wake-ups do not preempt (daemon.cpu_policy: {choice}, "
        f"{backend} backend)"
    )
    if refused:
        detail += f"; some threads were refused: {refused}"
    return CpuPolicy(now, detail, refused=bool(refused))


def log_cpu_policy(choice: CpuPolicyChoice, backend: str) -> CpuPolicy:
    """apply_cpu_policy, its outcome in the daemon's log (a refusal as a warning)."""
    result = apply_cpu_policy(choice, backend)
    if result.refused:
        log.warning("%s", result.detail)
    else:
        log.info("%s", result.detail)
    return result

"""daemon.cpu_policy (service/cpu_policy.py): a NIXL or Mooncake daemon started as
SCHED_OTHER runs every thread on SCHED_BATCH and says so in its log and status (`auto`);
UCX and MPI daemons stay as started unless told `batch`; `inherit` and an operator's own
policy (chrt, systemd's CPUSchedulingPolicy=) stand; a refusal leaves the daemon running
as it was, with a warning."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from daemon_harness import status

from kvxferd.commands.status_cmd import summary
from kvxferd.service import cpu_policy
from kvxferd.sim.cluster import LocalCluster

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setscheduler"), reason="Linux scheduling policies"
)

# A process with a thread started before the policy is applied and one after: both must be
# on the policy reported (the first is moved, the second inherits it).
_PROCESS = """
import os, sys, threading
from kvxferd.service.cpu_policy import apply_cpu_policy, policy_name
go, done = threading.Event(), threading.Event()
seen = {}
def early():
    go.wait()
    seen["early"] = policy_name(os.sched_getscheduler(0))
    done.set()
t = threading.Thread(target=early)
t.start()
result = apply_cpu_policy(sys.argv[1], sys.argv[2])
go.set(); done.wait(10)
late = threading.Thread(target=lambda: seen.update(late=policy_name(os.sched_getscheduler(0))))
late.start(); late.join()
print(result.policy, seen["early"], seen["late"], policy_name(os.sched_getscheduler(0)))
print(result.detail)
"""


def _run(choice: str, *launcher: str, backend: str = "NIXL") -> tuple[list[str], str]:
    out = subprocess.run(
        [*launcher, sys.executable, "-c", _PROCESS, choice, backend],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    first, detail = out.stdout.splitlines()[:2]
    return first.split(), detail


@pytest.mark.parametrize(
    "choice, backend", [("auto", "NIXL"), ("auto", "MOONCAKE"), ("batch", "UCX")]
)
def test_batch_moves_every_thread_of_a_process_started_as_other(choice: str, backend: str) -> None:
    policies, detail = _run(choice, backend=backend)
    assert policies == ["batch"] * 4, (policies, detail)
    assert f"wake-ups do not preempt (daemon.cpu_policy: {choice}, {backend} backend)" in detail


@pytest.mark.parametrize("backend", ["UCX", "MPI"])
def test_auto_leaves_the_two_sided_backends_as_started(backend: str) -> None:
    policies, detail = _run("auto", backend=backend)
    assert policies == ["other"] * 4, (policies, detail)
    assert f"auto, and the {backend} backend's transfers wait on the daemons' wake-ups" in detail


def test_inherit_leaves_the_policy_as_started() -> None:
    policies, detail = _run("inherit")
    assert policies == ["other"] * 4, (policies, detail)
    assert "as started (daemon.cpu_policy: inherit)" in detail


def test_an_operators_own_policy_stands() -> None:
    # SCHED_IDLE, as `chrt --idle` (or systemd's CPUSchedulingPolicy=idle) starts it.
    policies, detail = _run("batch", "chrt", "--idle", "0")
    assert policies == ["idle"] * 4, (policies, detail)
    assert "the operator chose it" in detail


def test_a_refusal_leaves_the_policy_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    # No real part refuses here (a seccomp profile would): the call is made to refuse.
    def refuse(pid: int, policy: int, param: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    result = cpu_policy.apply_cpu_policy("batch", "NIXL")
    assert result.policy == "other" and result.refused
    assert "SCHED_BATCH was refused: Operation not permitted" in result.detail


def test_a_daemon_runs_on_batch_and_says_so(cluster: LocalCluster) -> None:
    d = cluster.start_daemon("ctx", "context")
    tasks = os.listdir(f"/proc/{d.proc.pid}/task")
    assert len(tasks) > 1  # the data plane's thread at least
    assert {cpu_policy.policy_name(os.sched_getscheduler(int(t))) for t in tasks} == {"batch"}
    assert "CPU scheduling policy batch" in d.log_text()
    doc = status(d)
    assert doc["cpu_policy"] == {"policy": "batch", "configured": "auto"}
    assert "CPU scheduling policy batch (daemon.cpu_policy: auto)" in summary(doc)


def test_a_daemon_told_to_inherit_keeps_other(cluster: LocalCluster) -> None:
    d = cluster.start_daemon("gen", "generation", daemon={"cpu_policy": "inherit"})
    tasks = os.listdir(f"/proc/{d.proc.pid}/task")
    assert {cpu_policy.policy_name(os.sched_getscheduler(int(t))) for t in tasks} == {"other"}
    assert status(d)["cpu_policy"] == {"policy": "other", "configured": "inherit"}

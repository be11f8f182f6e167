"""Suite-wide: how `make test` splits the suite between workers, and a guard that no test
leaves transport variables in the test process's environment.

Importing ucxx writes UCX_* variables into os.environ (UCX_RNDV_THRESH, UCX_RNDV_FRAG_MEM_TYPE,
...), and every daemon a later test starts inherits them, NIXL's UCX included: a NIXL write
to a stopped peer then lands where the fault tests prove it cannot. That once made
test_faults fail only when a test importing ucxx (pytest.importorskip) ran first. Probe
packages with importlib.util.find_spec, and set such variables with monkeypatch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

# Variables read by the transports the daemons load (UCX inside NIXL and ucxx, Mooncake,
# MPICH and its process manager).
_WATCHED = ("UCX_", "UCXPY_", "MC_", "MPIR_", "PMI_", "HYDRA_")


# Directories whose files share one thing that must not exist twice at once: tests/cluster
# one network of hosts and one etcd (its package fixture ends after the directory's last
# test, so that test must run after all the others there, on the same worker), and
# tests/container one image build. Every other file is its own unit: its module fixtures
# (a vLLM instance, a pair of daemons) are set up once, on one worker.
_WHOLE_DIRS = ("tests/cluster/", "tests/container/")


def _unit(nodeid: str) -> str:
    """The unit of work one xdist worker runs whole, in collection order."""
    path = nodeid.split("::", 1)[0]
    return next((d for d in _WHOLE_DIRS if path.startswith(d)), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `--dist loadfile` (scripts/run-tests.sh), each xdist worker takes whole units
    (`_unit`): files, and the directories above whole. xdist's `loadgroup` would do this
    from marks, but with pytest 9.2 its group suffix never reached the node ids (checked at
    the end of collection) and every test went its own way: two workers each set up the same
    vLLM module fixture. So this hook widens the scope of loadfile's own scheduler instead.
    Any other `--dist` is xdist's as usual."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return UnitScheduling(config, log)


# Where UCX may see every device: tests of the daemon's own pin, and hosts in network
# namespaces (their processes would inherit a pin naming the root namespace's `lo`).
_OWN_DEVICES = (
    "tests/cluster/",
    "tests/container/",
    "tests/cli/test_demo_cluster.py",
    "tests/daemon/test_listeners.py",
)


@pytest.fixture(scope="module", autouse=True)
def _ucx_on_loopback(request: pytest.FixtureRequest) -> Iterator[None]:
    """Everything else runs on loopback: UCX (NIXL's, ucxx's, MPICH's), in this process
    and the children it starts, stays on `lo`, as the daemons pin theirs. Other tests'
    devices come and go beside it (podman's veths, the cluster tests' links), and UCX
    enumerating one as it vanished failed NIXL's createBackend and MPI_Init with
    "Destination is unreachable" (seen in CI; with a veth added and deleted in a loop, 3
    of 40 runs of the MPI bare pair failed so, and none of 50 runs of all four bare pairs
    once pinned)."""
    where = str(request.path.relative_to(request.config.rootpath))
    if where.startswith(_OWN_DEVICES) or "UCX_NET_DEVICES" in os.environ:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCX_NET_DEVICES", "lo")
        yield


def _watched() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_WATCHED)}


@pytest.fixture(autouse=True)
def _no_transport_variables_leak() -> Iterator[None]:
    before = _watched()
    yield
    after = _watched()
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        # Put the environment back first, so the next tests are not affected too.
        for k in changed:
            if k in before:
                os.environ[k] = before[k]
            else:
                os.environ.pop(k, None)
        pytest.fail(
            "this test left transport variables changed in the test process's environment "
            f"(daemons started later would inherit them): {', '.join(changed)}; probe packages "
            "with importlib.util.find_spec and set variables with monkeypatch",
            pytrace=False,
        )


# How much of each daemon's log a failed test's report shows: enough for the last
# connection, stall or fault, where CI's output is all there is to read.
_LOG_TAIL_LINES = 80


def _clusters(item: pytest.Item) -> list[Any]:
    """The LocalClusters a test used: fixtures that are one, or hold one (`.cluster`)."""
    from kvxferd.sim.cluster import LocalCluster

    found: list[Any] = []
    for value in getattr(item, "funcargs", {}).values():
        for c in (value, getattr(value, "cluster", None)):
            if isinstance(c, LocalCluster) and c not in found:
                found.append(c)
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report ends with the tail of each of its daemons' logs: a fault
    seen only in CI (a peer declared lost, a stalled loop's stacks) is then explained by
    what CI printed."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not report.failed or call.when == "teardown":
        return
    for cluster in _clusters(item):
        for d in cluster.daemons:
            lines = d.log_text().splitlines()[-_LOG_TAIL_LINES:]
            if lines:
                report.sections.append((f"daemon {d.name} log (last lines)", "\n".join(lines)))

"""Suite-wide guard: no test may leave transport variables in the test process's environment.

Importing ucxx writes UCX_* variables into os.environ (UCX_RNDV_THRESH, UCX_RNDV_FRAG_MEM_TYPE,
...), and every daemon a later test starts inherits them, NIXL's UCX included: a NIXL write
to a stopped peer then lands where the fault tests prove it cannot. That once made
test_faults fail only when a test importing ucxx (pytest.importorskip) ran first. Probe
packages with importlib.util.find_spec, and set such variables with monkeypatch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Variables read by the transports the daemons load (UCX inside NIXL and ucxx, Mooncake,
# MPICH and its process manager).
_WATCHED = ("UCX_", "UCXPY_", "MC_", "MPIR_", "PMI_", "HYDRA_")


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

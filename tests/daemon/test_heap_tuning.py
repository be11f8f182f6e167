"""kvxferd's processes keep the large buffers they free (service/heap_tuning.py): the pattern
that made the reference engine fault every page in again stops faulting, an operator's own
malloc settings stand, and a daemon says what it did."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvxferd.service.heap_tuning import keep_freed_heap, operator_choice
from kvxferd.sim.cluster import LocalCluster

GLIBC = (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")

# A request's temporaries as the reference engine's check of scattered blocks makes them: a
# gathered copy, a scratch array and flags, each ~1 MiB, written, then freed; the page faults
# of 40 such requests.
_CHURN = """
import resource, sys
import numpy as np
if sys.argv[1] == "tuned":
    from kvxferd.service.heap_tuning import keep_freed_heap
    print(keep_freed_heap(), file=sys.stderr)
def request():
    a = np.ones(1 << 20, np.uint8)
    b = np.ones(1 << 20, np.uint8)
    c = np.ones(1 << 20, np.uint8)
    return int(a[-1]) + int(b[-1]) + int(c[-1])
request()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    request()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if operator_choice({k: v}) is None}
    out = subprocess.run(
        [sys.executable, "-c", _CHURN, mode], env=env, capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc")
def test_freed_buffers_are_kept_instead_of_faulted_in_again() -> None:
    plain, tuned = _faults("plain"), _faults("tuned")
    # Untuned, each request's 3 MiB come back from the kernel: ~768 faults a request.
    assert plain > 40 * 256, plain
    assert tuned < plain // 20, (tuned, plain)


@pytest.mark.parametrize(
    "environ, chosen",
    [
        ({"MALLOC_TRIM_THRESHOLD_": "1"}, "MALLOC_TRIM_THRESHOLD_"),
        ({"MALLOC_MMAP_THRESHOLD_": "1"}, "MALLOC_MMAP_THRESHOLD_"),
        ({"MALLOC_TOP_PAD_": "1"}, "MALLOC_TOP_PAD_"),
        (
            {"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=1:glibc.malloc.top_pad=1"},
            "GLIBC_TUNABLES glibc.malloc.top_pad",
        ),
        ({"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=1"}, None),
        ({"PATH": "/bin"}, None),
    ],
)
def test_the_operators_own_malloc_settings_stand(
    environ: dict[str, str], chosen: str | None
) -> None:
    assert operator_choice(environ) == chosen
    if chosen is not None:
        assert keep_freed_heap(environ) == f"malloc thresholds left as set by {chosen}"


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc")
def test_a_daemon_says_what_it_did(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"):
        monkeypatch.delenv(name, raising=False)
    d = cluster.start_daemon("ctx", "context")
    assert "malloc keeps freed buffers: mmap threshold 32 MiB, trim threshold 64 MiB" in (
        d.log_text()
    )
    assert d.stop() == 0

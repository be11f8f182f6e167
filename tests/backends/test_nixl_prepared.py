"""NIXL's prepared descriptor lists (kvxferd.backends.nixl_prepared) with real agents: a
write that qualifies goes out from lists prepared once and lands where the usual path
would put it; one that does not, or whose announced region the peer never registered,
takes the usual path; a peer's lists die with its metadata, ours with our registration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.backends.test_nixl_memory import _needs_nixl

REPO = Path(__file__).resolve().parents[2]

# Real NIXL agents run in a child process (tests/conftest.py: the test process never loads
# UCX).
_SCRIPT = """
import json
import numpy as np
from kvxferd.backends.nixl import NixlBackend
from kvxferd.errors import TransferError

U = 4096  # one "block"
a, b = NixlBackend("prep-a"), NixlBackend("prep-b")
src = np.random.default_rng(1).integers(0, 256, 64 * U, dtype=np.uint8)
dst = np.zeros(64 * U, dtype=np.uint8)
ra = a.register(src.ctypes.data, src.nbytes)
b.register(dst.ctypes.data, dst.nbytes)
peer = a.add_peer(b.metadata()); a.connect(peer)
regions = [(dst.ctypes.data, dst.nbytes)]
out = {}

def segs(arr, blocks, unit=U, phase=0):
    return np.array([[arr.ctypes.data + phase + k * unit, unit] for k in blocks], np.int64)

def write(local, remote, **kw):
    handle, status = a.post_write(local, remote, peer, **kw)
    while int(status) == 0:
        status = a.poll(handle)
    a.release(handle)
    return int(status) == 1

def moved(sblocks, dblocks, unit=U, phase=0, into=dst):
    at = lambda arr, k: arr[phase + k * unit : phase + (k + 1) * unit]
    return all((at(into, d) == at(src, s)).all() for s, d in zip(sblocks, dblocks))

n = lambda: a._prepared.prepared_writes

# One block, then three scattered ones, then the last block of each region: prepared.
before = n()
out["one"] = write(segs(src, [5]), segs(dst, [9]), remote_regions=regions) and moved([5], [9])
out["three"] = write(
    segs(src, [0, 7, 2]), segs(dst, [63, 1, 30]), remote_regions=regions
) and moved([0, 7, 2], [63, 1, 30])
out["edges"] = write(segs(src, [63]), segs(dst, [0]), remote_regions=regions) and moved([63], [0])
out["prepared"] = n() - before

# Not qualifying: no regions told; segments of two lengths; a phase other than the first.
before = n()
out["no_hint"] = write(segs(src, [3]), segs(dst, [4])) and moved([3], [4])
mixed_l = np.array([[src.ctypes.data, U], [src.ctypes.data + 8 * U, 2 * U]], np.int64)
mixed_r = np.array([[dst.ctypes.data + 10 * U, U], [dst.ctypes.data + 20 * U, 2 * U]], np.int64)
out["mixed"] = write(mixed_l, mixed_r, remote_regions=regions) and moved([0, 8, 9], [10, 20, 21])
out["usual"] = n() - before
# Another phase of the same unit: its own list, still right.
before = n()
out["phase"] = write(
    segs(src, [11], phase=512), segs(dst, [12], phase=512), remote_regions=regions
) and moved([11], [12], phase=512)
out["phase_prepared"] = n() - before

# An announced region the peer never registered (larger than its buffer): NIXL refuses to
# prepare it, and the write goes the usual way, to the right place.
before = n()
too_big = [(dst.ctypes.data, dst.nbytes * 4)]
out["stale_region"] = write(segs(src, [6]), segs(dst, [6]), remote_regions=too_big) and moved(
    [6], [6]
)
out["stale_prepared"] = n() - before

# The peer registers new memory and its metadata is loaded again: its old lists are gone,
# and writes into the new buffer are prepared against the new metadata.
dst2 = np.zeros(16 * U, dtype=np.uint8)
b.register(dst2.ctypes.data, dst2.nbytes)
a.add_peer(b.metadata())
out["lists_after_reload"] = len(a._prepared._remote.get(peer, {}))
before = n()
ok = write(segs(src, [1]), segs(dst2, [15]), remote_regions=[(dst2.ctypes.data, dst2.nbytes)])
out["new_region"] = ok and moved([1], [15], into=dst2)
out["new_prepared"] = n() - before

# Our registration ends: its lists go with it, and a write out of that memory is refused
# rather than posted from a list prepared while it was registered.
a.deregister(ra)
out["local_regions_after"] = len(a._prepared._local)
try:
    write(segs(src, [2]), segs(dst, [2]), remote_regions=regions)
    out["after_deregister"] = "posted"
except TransferError as exc:
    out["after_deregister"] = str(exc)
a.close(); b.close()
print("RESULT " + json.dumps(out))
"""


def test_prepared_lists_move_the_right_bytes_and_die_with_their_metadata() -> None:
    _needs_nixl()
    res = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout + res.stderr[-3000:]
    out: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    assert out["one"] and out["three"] and out["edges"], out
    assert out["prepared"] == 3, out
    assert out["no_hint"] and out["mixed"] and out["usual"] == 0, out
    assert out["phase"] and out["phase_prepared"] == 1, out
    assert out["stale_region"] and out["stale_prepared"] == 0, out
    assert out["lists_after_reload"] == 0, out
    assert out["new_region"] and out["new_prepared"] == 1, out
    assert out["local_regions_after"] == 0, out
    assert out["after_deregister"] != "posted", out

"""The data plane's call discipline: cheap calls of a backend that allows it run on the
event loop's thread, but never while the worker thread has a call queued or running, and
the backend never sees two calls at once; a backend that does not allow it always gets
its calls on the worker thread. A real NIXL agent then posts, polls and releases on the
loop's thread (in a child process: the test process never loads UCX)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvxferd.transceiver.dataplane import DataPlane

REPO = Path(__file__).resolve().parents[2]


class _Recorder:
    """Records the thread of every call and whether two ever overlapped."""

    name = "REC"
    agent_name = "rec"

    def __init__(self, inline: bool) -> None:
        self.inline_calls = inline
        self.threads: list[int] = []
        self.inside = 0
        self.overlapped = False
        self.release_worker = threading.Event()

    def cheap(self) -> int:
        self.inside += 1
        self.overlapped |= self.inside > 1
        self.threads.append(threading.get_ident())
        self.inside -= 1
        return 7

    def slow(self) -> None:
        self.inside += 1
        self.overlapped |= self.inside > 1
        self.release_worker.wait(10)
        self.inside -= 1

    def close(self) -> None:
        pass


def _run(inline: bool) -> tuple[_Recorder, int, list[int]]:
    rec = _Recorder(inline)

    async def main() -> tuple[int, list[int]]:
        dp = DataPlane(lambda: rec)  # type: ignore[arg-type, return-value]
        await dp.start()
        loop_thread = threading.get_ident()
        assert await dp.call_cheap(rec.cheap) == 7  # worker idle
        slow = asyncio.ensure_future(dp.call(rec.slow))
        await asyncio.sleep(0.05)  # the worker is inside slow() now
        during = asyncio.ensure_future(dp.call_cheap(rec.cheap))
        await asyncio.sleep(0.05)
        queued_while_busy = not during.done()  # it waited for the worker: no inline call
        rec.release_worker.set()
        await slow
        await during
        await dp.close()
        return loop_thread, [dp.inline_calls, int(queued_while_busy)]

    loop_thread, counts = asyncio.run(main())
    return rec, loop_thread, counts


def test_cheap_call_runs_on_the_loop_thread_only_when_the_worker_is_idle() -> None:
    rec, loop_thread, (inline_calls, queued_while_busy) = _run(inline=True)
    assert rec.threads[0] == loop_thread  # idle worker: taken right here
    assert rec.threads[1] != loop_thread  # worker busy: queued behind the slow call
    assert inline_calls == 1
    assert queued_while_busy == 1
    assert not rec.overlapped


def test_backend_without_inline_calls_always_gets_the_worker_thread() -> None:
    rec, loop_thread, (inline_calls, _) = _run(inline=False)
    assert loop_thread not in rec.threads
    assert inline_calls == 0
    assert not rec.overlapped


_NIXL_INLINE = """
import asyncio, json
import numpy as np
from kvxferd.backends.nixl import NixlBackend
from kvxferd.transceiver.dataplane import DataPlane

async def main():
    out = {}
    a_dp = DataPlane(lambda: NixlBackend("inline-a"))
    b_dp = DataPlane(lambda: NixlBackend("inline-b"))
    a, b = await a_dp.start(), await b_dp.start()
    src = np.random.default_rng(1).integers(0, 255, 32 << 10, dtype=np.uint8)
    dst = np.zeros_like(src)
    await a_dp.call(a.register, src.ctypes.data, src.nbytes)
    await b_dp.call(b.register, dst.ctypes.data, dst.nbytes)
    peer = await a_dp.call(a.add_peer, await b_dp.call(b.metadata))
    await a_dp.call(a.connect, peer)
    seg = lambda arr: np.array([[arr.ctypes.data, arr.nbytes]], dtype=np.int64)
    for _ in range(20):
        dst[:] = 0
        handle, status = await a_dp.call_cheap(a.post_write, seg(src), seg(dst), peer)
        while int(status) == 0:
            status = await a_dp.call_cheap(a.poll, handle)
        await a_dp.call_cheap(a.release, handle)
        out.setdefault("ok", True)
        out["ok"] &= int(status) == 1 and bool((src == dst).all()) and handle.released
    out["inline"] = a_dp.inline_calls
    await a_dp.close(); await b_dp.close()
    print("RESULT " + json.dumps(out))

asyncio.run(main())
"""


def test_nixl_posts_polls_and_releases_on_the_loop_thread() -> None:
    if __import__("importlib").util.find_spec("nixl_cu12") is None:
        pytest.skip("nixl-cu12 is not installed")
    proc = subprocess.run(
        [sys.executable, "-c", _NIXL_INLINE],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["ok"], out
    assert out["inline"] >= 20, out  # every post at least, none through the worker

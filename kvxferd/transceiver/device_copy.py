"""Gather and scatter in GPU memory, and the daemon's device staging: a thin executor.

The arithmetic (which bytes go where, per round, with head slices) is the host path's
(transceiver/copyplan.py, run by bounce.ArrayCopier, tested exhaustively on the host);
this module only runs it with cupy on the daemon's own stream: one kernel launch per
copy, never a memcpy per segment. Rows of 512 bytes or more, 16-byte aligned (whole
blocks, layer pieces of the usual geometries) go through device_rows' kernel; others
(head slices of a few hundred bytes per token) through one `take` (gather) or one indexed
assignment (scatter) over word rows.

Ordering: the engine synchronises before `send` (docs/engine-integration.md), so a
gather reads finished KV. A copy is complete before it is reported: a gather's
reservation before NIXL writes it out, and a scatter's blocks before the receive is
reported `done` (BounceBuffers awaits the copy; the receive coordinator reports only after
that).

How a daemon's copy runs (`DeviceCopier.on_loop`): launched from the event loop's own
thread onto that thread's stream, then awaited by polling an event recorded after it. A
launch takes ~0.13 ms of the loop's time on an H200 (benchmarks/gpu_rows.py; its largest part the
copy plan); the hop to a copy thread and back that it replaces cost ~0.4 ms per copy (a
traced 1000 MiB bounce request: 0.32 ms from the gather's call to the copy's start, 0.12 ms
from its end back to the loop; as much again for the scatter). Because every copy of a
daemon goes onto that one stream, in order, a copy into or out of a reservation that is
reused runs after the copy before it; and a copy whose caller is cancelled is still
awaited to its end (up to CANCELLED_WAIT_S) before the cancel goes on, so its reservation
and blocks are given back only once the device let go of them.

cupy is imported only when a DeviceCopier is made, never at module import: a host
without a GPU imports this module and gets DeviceUnavailableError (with the probe's
reason) only if it asks for device staging.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kvxferd.backends.base import vram
from kvxferd.memory.device import DeviceRegion, DeviceUnavailableError, probe
from kvxferd.transceiver.bounce import ArrayCopier, BounceBuffers
from kvxferd.transceiver.device_rows import RowKernel
from kvxferd.transceiver.writes import next_pause

log = logging.getLogger("kvxferd.device")


def _cupy_for(device: int) -> ModuleType:
    """cupy, once the probe found a usable device `device`; else why not."""
    found = probe()
    if not found.available:
        raise DeviceUnavailableError(found.why)
    if not 0 <= device < found.count:
        raise DeviceUnavailableError(
            f"CUDA device {device} does not exist here: this process sees {found.count} "
            f"(ordinals 0..{found.count - 1}; CUDA_VISIBLE_DEVICES?)"
        )
    import cupy

    module: ModuleType = cupy
    return module


class DeviceCopier(ArrayCopier):
    """A Copier (transceiver/bounce.py) over device memory on CUDA device `device`.

    `xp` is the array module, cupy by default (imported here, lazily). Passing another
    module with cupy's surface (`take`, `asarray`, `cuda.Device`, `cuda.Stream`) is for
    tests only: it lets the host check the executor's protocol with a stand-in."""

    def __init__(self, device: int, *, xp: ModuleType | None = None) -> None:
        module = xp if xp is not None else _cupy_for(device)
        kernel = RowKernel(module)
        super().__init__(module, run=self._on_stream, rows=kernel)
        self._kernel = kernel
        self.device = device
        # One stream per copying thread (a daemon copies from its event loop's thread
        # only: on_loop), made there under the device on first use: a stream belongs to
        # the device current when it is created, and that thread may not be the one that
        # built the copier.
        self._local = threading.local()
        self._streams: list[Any] = []
        self._lock = threading.Lock()

    def _stream(self) -> Any:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            # Non-blocking: our copies never wait for (nor hold up) the legacy default
            # stream another library in this process may use.
            stream = self.xp.cuda.Stream(non_blocking=True)
            self._local.stream = stream
            with self._lock:
                self._streams.append(stream)
        return stream

    def _on_stream(self, copy: Callable[[], None]) -> None:
        """Run one copy on our stream on our device; return once the device finished it,
        or, inside `on_loop`, once it is launched (recording after it what to await)."""
        with self.xp.cuda.Device(self.device):
            stream = self._stream()
            with stream:
                copy()
            if getattr(self._local, "deferring", False):
                event = self.xp.cuda.Event(block=False, disable_timing=True)
                event.record(stream)
                self._local.launched = event
                return
            # The caller's next step (a NIXL write of the reservation, or `done`) must see
            # the bytes in place: wait for the copy here, in the calling thread.
            stream.synchronize()

    def warm(self) -> None:
        """Compile the row kernel now (at the daemon's start) rather than in its first
        request. Where it cannot be compiled, copies keep to take and assignment, and the
        log says why once."""
        if self.rows is None:
            return
        try:
            with self.xp.cuda.Device(self.device):
                self._kernel.warm()
        except Exception as exc:  # NVRTC missing or broken: a slower copy still works
            log.warning(
                "device copies on CUDA device %d use cupy's take: the row kernel did not "
                "compile (%s)",
                self.device,
                exc,
            )
            self.rows = None

    def launch(self, copy: Callable[..., None], *args: object) -> Any:
        """Run `copy(*args)` (one of our gather/scatter calls) in this thread up to its
        launch, without waiting for the device: the event recorded after it, or None when
        nothing was launched."""
        self._local.deferring, self._local.launched = True, None
        try:
            copy(*args)  # checks its arguments, then launches: raises before any launch
            return self._local.launched
        finally:
            self._local.deferring, self._local.launched = False, None

    async def on_loop(self, copy: Callable[..., None], *args: object) -> None:
        """Launch `copy(*args)` from the event loop's thread and return once the device
        finished it (BounceBuffers' CopyRunner)."""
        event = self.launch(copy, *args)
        if event is not None:
            await _until_done(event)

    def close(self) -> None:
        with self._lock:
            streams, self._streams = self._streams, []
        for stream in streams:
            synchronize = getattr(stream, "synchronize", None)
            if callable(synchronize):
                synchronize()  # nothing of ours may still run when the regions are freed


# How long a cancelled copy is still waited for. A copy takes milliseconds; a device that
# has not finished one in this long is hung, and a cancel (a deadline, a shutdown) must not
# hang with it. Later copies on the same stream cannot run before it either.
CANCELLED_WAIT_S = 5.0


async def _until_done(event: Any) -> None:
    """Poll `event` on the loop as device writes are polled (writes.next_pause: flat out
    for the first ~2 ms, since a pause under 0.5 ms is one turn of uvloop). A cancel waits
    for the device too (up to CANCELLED_WAIT_S), then goes on: until then the copy may
    still touch the caller's reservation or blocks, which the caller gives back as soon as
    it sees the cancel."""
    start, pause, cancelled_at = time.monotonic(), 0.0, None
    while not event.done:
        now = time.monotonic()
        if cancelled_at is not None and now - cancelled_at > CANCELLED_WAIT_S:
            log.error(
                "a cancelled device copy has not finished after %.0f s; giving its buffers "
                "back anyway (is the GPU hung?)",
                now - cancelled_at,
            )
            break
        pause = next_pause(pause, now - start, device=True)
        try:
            await asyncio.sleep(pause)
        except asyncio.CancelledError:
            cancelled_at = cancelled_at or time.monotonic()
    if cancelled_at is not None:
        raise asyncio.CancelledError


def device_buffers(nbytes: int, device: int) -> BounceBuffers:
    """The daemon's send and receive staging in VRAM on `device` (its own ordinal), each
    `nbytes`, copied by a DeviceCopier; registered by the daemon as VRAM on that device
    and announced to peers as such (Info.bounce_memory "vram", bounce_device)."""
    copier = DeviceCopier(device)  # raises DeviceUnavailableError first, with the reason
    copier.warm()
    return BounceBuffers(
        nbytes,
        copier,
        memory=vram(device),
        backing=lambda n, label: DeviceRegion.allocate(n, device, f"bounce {label}"),
        run_copy=copier.on_loop,
    )

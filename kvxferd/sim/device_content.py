"""The reference content (kvxferd.sim.content) for pools in device memory, made and checked
on the device.

A pool in VRAM is never copied to the host to be filled or verified: the expected bytes are
computed with the array module `xp` (cupy on a GPU) from the same pattern functions the host
content uses, written into the pool with one scatter per chunk and compared after one gather
per chunk, both through transceiver.bounce.ArrayCopier, whose packed order (logical block,
layer, K/V) is exactly the (blocks, pieces, piece bytes) shape of the expected bytes. Only a
mismatch brings a chunk to the host, to name the first wrong byte as the host check does.

Everything here is written against `xp` alone, so numpy gives exactly the host content: that
equality is what the CPU tests check (no GPU there); on a GPU the same code runs in cupy.

Ordering: these calls queue work on the current stream of the current device and return
before it ran (except verification, whose result comes back to the host). An engine must
therefore call `synchronize` before handing blocks to its daemon (send after a fill, recv
after a clear): the daemon copies on its own streams, in another process, and sees only
what the device finished (docs/engine-integration.md, "GPU pools").
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, Concatenate, Final, ParamSpec, TypeVar, cast

import numpy as np

from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import BlockIds, KvLayout, LayoutError
from kvxferd.sim.content import (
    VerifyResult,
    _bases,
    _describe,
    _Found,
    _local_expected,
    _verified_blocks,
)
from kvxferd.transceiver.bounce import ArrayCopier

__all__ = [
    "DeviceContent",
    "clear_device_blocks",
    "fill_device_blocks",
    "verify_device_blocks",
    "vram_problem",
]

# Work is done about this many bytes of blocks at a time: the expected bytes of a chunk and
# its gathered copy are two temporaries of this size on the device.
_CHUNK_BYTES: Final = 64 << 20

P = ParamSpec("P")
T = TypeVar("T")


def vram_problem() -> str | None:
    """Why `--memory vram` cannot run in this process (None: a CUDA device is usable): the
    device probe's own reason, one line."""
    from kvxferd.memory.device import probe

    found = probe()
    if found.available:
        return None
    return f"--memory vram needs a usable CUDA device, and this host has none: {found.why}"


def _check(pool: Any, layout: KvLayout) -> None:
    if pool.ndim != 1 or pool.dtype != np.uint8:
        raise LayoutError("pool must be a 1-D uint8 array (a view of the whole pool)")
    if pool.size < layout.pool_bytes:
        raise LayoutError(f"pool array has {pool.size} bytes, the layout needs {layout.pool_bytes}")
    if not layout.named:
        raise LayoutError(
            f"the reference content needs a block-major or layer-major pool, not {layout.major}"
        )


def _chunks(layout: KvLayout, ids: np.ndarray[Any, Any]) -> Iterator[tuple[int, list[int]]]:
    """(first logical index, physical ids) of chunks of about _CHUNK_BYTES (ids on the
    host: a plan's arithmetic is host work, only the copies run on the device)."""
    step = max(1, _CHUNK_BYTES // layout.block_bytes)
    for j in range(0, ids.shape[0], step):
        yield j, [int(b) for b in ids[j : j + step]]


def _expected(xp: ModuleType, layout: KvLayout, bases: Any, tp: TpRank | None) -> Any:
    """The bytes blocks with `bases` (m, regions) hold, (m, regions, piece_bytes), contiguous:
    the packed order of ArrayCopier's whole-block gather and scatter."""
    return xp.ascontiguousarray(_local_expected(bases, layout, tp, xp))


def fill_device_blocks(
    pool: Any,
    layout: KvLayout,
    blocks: BlockIds,
    seed: int,
    start: int = 0,
    *,
    tp: TpRank | None = None,
    xp: ModuleType = np,
) -> None:
    """content.fill_blocks for a pool that is an `xp` array (cupy: in device memory)."""
    ids = layout.check_blocks(blocks)
    _check(pool, layout)
    copier = ArrayCopier(xp)
    bases = _bases(seed, start + ids.shape[0], layout.pieces_per_block, xp)[start:]
    for j, chunk in _chunks(layout, ids):
        expected = _expected(xp, layout, bases[j : j + len(chunk)], tp)
        copier.scatter(expected.reshape(-1), pool, layout, chunk)


def clear_device_blocks(
    pool: Any, layout: KvLayout, blocks: BlockIds, *, xp: ModuleType = np
) -> None:
    """content.clear_blocks for a pool that is an `xp` array."""
    ids = layout.check_blocks(blocks)
    _check(pool, layout)
    copier = ArrayCopier(xp)
    for _, chunk in _chunks(layout, ids):
        zeros = xp.zeros(len(chunk) * layout.block_bytes, dtype=np.uint8)
        copier.scatter(zeros, pool, layout, chunk)


def verify_device_blocks(
    pool: Any,
    layout: KvLayout,
    blocks: BlockIds,
    seed: int,
    num_tokens: int,
    *,
    tp: TpRank | None = None,
    xp: ModuleType = np,
) -> VerifyResult:
    """content.verify_blocks for a pool that is an `xp` array: the same checks, the same
    bytes_checked and the same description of the first wrong byte, compared on the device."""
    ids = _verified_blocks(layout, blocks, num_tokens)
    tpb = layout.tokens_per_block
    _check(pool, layout)
    copier = ArrayCopier(xp)
    regions, piece = layout.pieces_per_block, layout.piece_bytes
    bases = _bases(seed, ids.shape[0], regions, xp)
    full = num_tokens // tpb  # blocks checked whole; a partial one may follow
    found: _Found | None = None
    # One gather buffer for every chunk: at most a chunk, at least the partial last block.
    per_chunk = max(1, _CHUNK_BYTES // layout.block_bytes)
    scratch = xp.empty(min(max(full, 1), per_chunk) * layout.block_bytes, dtype=np.uint8)

    def compare(j: int, chunk: list[int], nbytes: int) -> _Found | None:
        """Blocks `chunk` (logical j...) against their content, the first `nbytes` of each
        piece; the first wrong byte, or None."""
        m = len(chunk)
        expected = _expected(xp, layout, bases[j : j + m], tp)[..., :nbytes]
        out = scratch[: m * layout.block_bytes]
        copier.gather(pool, layout, chunk, out)
        stored = out.reshape(m, regions, piece)[..., :nbytes]
        wrong = stored != expected
        if not bool(wrong.any()):  # the one value that crosses to the host when all is well
            return None
        # A mismatch: this chunk comes to the host to be described.
        wrong_h = _host(xp, wrong)
        jj, r, off = (int(x) for x in np.unravel_index(int(np.argmax(wrong_h)), wrong_h.shape))
        want = int(_host(xp, expected[jj, r, off]))
        got = int(_host(xp, stored[jj, r, off]))
        return (j + jj, r, off, want, got)

    for j, chunk in _chunks(layout, ids[:full]):
        hit = compare(j, chunk, piece)
        if hit is not None and found is None:
            found = hit
    checked = full * layout.block_bytes

    tail_tokens = num_tokens - full * tpb
    if tail_tokens:
        nbytes = tail_tokens * layout.token_bytes
        hit = compare(full, [int(ids[full])], nbytes)
        checked += regions * nbytes
        if found is None:
            found = hit
    mismatch = None if found is None else _describe(layout, ids, found, tp or TpRank())
    return VerifyResult(ok=found is None, bytes_checked=checked, first_mismatch=mismatch)


def _host(xp: ModuleType, value: Any) -> Any:
    """`value` as a numpy value (cupy: copied from the device)."""
    return value if xp is np else xp.asnumpy(value)


def _on_own_device(fn: Callable[P, T]) -> Callable[Concatenate[DeviceContent, P], T]:
    """DeviceContent's method for the module function `fn`: its parameters and docs, run
    with the content's device current and `xp` the content's array module unless given."""

    def method(self: DeviceContent, /, *args: P.args, **kwargs: P.kwargs) -> T:
        with self._on_device():
            # fn takes `xp` besides P, which the ParamSpec cannot spell.
            on_xp: Callable[P, T] = functools.partial(cast("Callable[..., T]", fn), xp=self.xp)
            return on_xp(*args, **kwargs)

    functools.update_wrapper(method, fn)
    return method


class DeviceContent:
    """The content calls of an engine whose pools are cupy arrays on CUDA device `device`:
    each runs with that device current (an engine's pool need not be on device 0), and
    `synchronize` waits for all of them, as the engine must before send and recv."""

    def __init__(self, device: int = 0, xp: ModuleType | None = None) -> None:
        if xp is None:
            import cupy

            xp = cupy
        self.xp: ModuleType = xp
        self.device = device

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        if self.xp is np:
            yield
            return
        with self.xp.cuda.Device(self.device):
            yield

    # The module's calls, each under this content's device and with its array module.
    fill = _on_own_device(fill_device_blocks)
    clear = _on_own_device(clear_device_blocks)
    verify = _on_own_device(verify_device_blocks)

    def synchronize(self) -> None:
        """Wait until the device finished every fill and clear issued so far, on any stream:
        the daemon reads (send) and writes (recv) these blocks from its own process and
        streams, which the device orders after nothing of ours."""
        if self.xp is np:
            return
        with self._on_device():
            self.xp.cuda.Device(self.device).synchronize()

"""Verifiable KV content for the reference engine.

Every byte of a request's KV is a function of (request seed, logical block, layer, kv, word
within the piece), so a byte that is missing, stale, shifted, or landed in the wrong block,
layer or kv slot is detected, and its location is reported.

The pattern, per piece (one (layer, kv) slice of one logical block), in little-endian uint64
words:  word[w] = base(seed, block, layer * kv_factor + kv) + w * RAMP  (mod 2**64),
where base() is a splitmix64-style hash and RAMP an odd constant. The word index covers the
tokens (token-major) and the words inside each token. A piece whose size is not a multiple of
8 bytes holds the first piece_bytes bytes of the same word sequence.

Tensor parallelism: the pattern is defined over the *full-head* piece (every KV head of the
model, tokens_per_block x num_kv_heads * tp_size heads). The pool of tensor-parallel rank r of
n holds, in each token, its slice of heads [r * h, (r + 1) * h) of that piece. So KV written by
two context ranks into one generation pool (head-merge), or by one context rank into two
generation pools (head-split), verifies exactly like a transfer between equal sizes, and a head
that landed at the wrong place is reported with its global head index. With tp_size 1 the
full-head piece is the pool's own piece: the content (and the fast paths) are unchanged.

Work is vectorised and chunked: logical blocks are taken about 1 MiB at a time; a chunk whose
physical blocks are consecutive is read and written through strided views of the pool (no
copy), any other chunk through a gather/scatter that moves each block (block-major) or piece
(layer-major) as one numpy element, near memcpy speed.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Final

import numpy as np
import numpy.typing as npt

from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import BLOCK_MAJOR, BlockIds, KvLayout, LayoutError, block_runs

__all__ = [
    "VerifyResult",
    "clear_blocks",
    "fill_blocks",
    "request_seed",
    "verify_blocks",
]

_U64: Final = np.dtype("<u8")
_RAMP: Final = np.uint64(0x9E3779B97F4A7C15)
_MIX_BLOCK: Final = np.uint64(0xD1B54A32D192ED03)
_MIX_REGION: Final = np.uint64(0xAEF17502108EF2D9)
# Verification works through a scratch buffer of about this many bytes, small enough to stay
# in the CPU cache so that the pool is the only memory traffic.
_CHUNK_BYTES: Final = 1 << 20

U8 = npt.NDArray[np.uint8]
U64 = npt.NDArray[np.uint64]


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verify_blocks().

    ok: every checked byte holds the expected content. bytes_checked: how many bytes were
    compared. first_mismatch: where the first wrong byte is (logical block, physical block,
    layer, kv, token, byte), None when ok.
    """

    ok: bool
    bytes_checked: int
    first_mismatch: str | None = None


def request_seed(request_id: str) -> int:
    """A stable 63-bit seed for a request id (same on every host and Python version)."""
    digest = hashlib.blake2b(request_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# -- pattern ---------------------------------------------------------------------------------


# Up to this many bases are worked out in Python: numpy's dozen operations on a tiny array
# cost ~18 us, more than the bytes of a one-block request (kvxferd bench --small runs
# thousands of those a second, on the cores the daemons use).
_SMALL_BASES: Final = 16
_M64: Final = (1 << 64) - 1


def _bases(seed: int, num_logical: int, regions: int, xp: ModuleType = np) -> U64:
    """base(seed, block, region) for all logical blocks and regions, shape (blocks, regions).

    `xp`: the array module to compute in (numpy, or cupy for a pool in device memory,
    kvxferd.sim.device_content); only numpy-and-cupy-common operations, so both give the
    same words."""
    _check_seed(seed)
    if xp is np and num_logical * regions <= _SMALL_BASES:
        return _few_bases(seed, num_logical, regions)
    j = xp.arange(num_logical, dtype=np.uint64)[:, None]
    r = xp.arange(regions, dtype=np.uint64)[None, :]
    # The array first and the seed last (the same sum mod 2**64): a numpy scalar on the left
    # of a cupy array would leave the choice of module to numpy.
    z: U64 = (j + np.uint64(1)) * _MIX_BLOCK + (r + np.uint64(1)) * _MIX_REGION + np.uint64(seed)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def _few_bases(seed: int, num_logical: int, regions: int) -> U64:
    """_bases on numpy, in Python integers (the same words, mod 2**64)."""
    mb, mr = int(_MIX_BLOCK), int(_MIX_REGION)
    out = []
    for j in range(num_logical):
        for r in range(regions):
            z = ((j + 1) * mb + (r + 1) * mr + seed) & _M64
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
            out.append(z ^ (z >> 31))
    return np.array(out, dtype=np.uint64).reshape(num_logical, regions)


def _ramp(words: int, xp: ModuleType = np) -> U64:
    if xp is np:
        return _host_ramp(words)
    ramp: U64 = xp.arange(words, dtype=np.uint64) * _RAMP
    return ramp


@functools.lru_cache(maxsize=16)
def _host_ramp(words: int) -> U64:
    """The ramp on the host, made once per length (read-only: every caller shares it)."""
    ramp: U64 = np.arange(words, dtype=np.uint64) * _RAMP
    ramp.flags.writeable = False
    return ramp


def _expected_bytes(bases: U64, piece_bytes: int, xp: ModuleType = np) -> U8:
    """The content of pieces with the given bases (any shape), as (..., piece_bytes) uint8."""
    words = -(-piece_bytes // 8)
    full = (bases[..., None] + _ramp(words, xp)).astype(_U64, copy=False)
    return full.view(np.uint8)[..., :piece_bytes]


def _sliced(tp: TpRank | None) -> bool:
    return tp is not None and tp.size > 1


def _piece_ramp(layout: KvLayout, tp: TpRank | None) -> U64 | None:
    """The word ramp of a piece as the pool of rank `tp` stores it, or None when that piece is
    not whole words: word i of the rank's piece is base + ramp[i]. Unsliced, the plain ramp.
    Sliced, each token's slice of heads starts on a word of the full-head piece (its bytes
    per token a multiple of 8), so the slice is words of the full-head pattern too, and
    fill and verify take the word paths instead of building the full-head bytes and
    comparing byte by byte (a head-split's engine verified 3-4x slower per byte)."""
    if layout.piece_bytes % 8:
        return None
    if not _sliced(tp):
        return _host_ramp(layout.piece_bytes // 8)
    assert tp is not None
    if layout.token_bytes % 8:
        return None
    return _slice_ramp(layout.tokens_per_block, layout.token_bytes // 8, tp.size, tp.rank)


@functools.lru_cache(maxsize=16)
def _slice_ramp(tokens: int, local_words: int, size: int, rank: int) -> U64:
    """Ramp of rank `rank`'s slice (`local_words` words a token) of a full-head piece of
    `tokens` tokens and `size` slices a token (read-only, shared)."""
    token = np.arange(tokens, dtype=np.uint64)[:, None] * np.uint64(local_words * size)
    word = np.arange(local_words, dtype=np.uint64)[None, :] + np.uint64(rank * local_words)
    ramp: U64 = ((token + word) * _RAMP).reshape(-1)
    ramp.flags.writeable = False
    return ramp


def _local_expected(bases: U64, layout: KvLayout, tp: TpRank | None, xp: ModuleType = np) -> U8:
    """What a pool of `layout` held by rank `tp` stores for pieces with the given bases
    (any shape): the rank's heads of each token of the full-head piece, (..., piece_bytes)."""
    if not _sliced(tp):
        return _expected_bytes(bases, layout.piece_bytes, xp)
    assert tp is not None
    tpb, local = layout.tokens_per_block, layout.token_bytes
    full = _expected_bytes(bases, layout.piece_bytes * tp.size, xp)
    per_token = full.reshape(*bases.shape, tpb, local * tp.size)
    mine = per_token[..., tp.rank * local : (tp.rank + 1) * local]
    local_bytes: U8 = xp.ascontiguousarray(mine).reshape(*bases.shape, layout.piece_bytes)
    return local_bytes


# -- pool access -----------------------------------------------------------------------------


class _Pool:
    """The pieces of a pool, read and written a run of consecutive blocks at a time.

    Pieces are handled in `unit`s: uint64 words when a piece is a whole number of words, else
    bytes. Every array here is (blocks, pieces_per_block, units per piece), a view of the
    pool: a run of consecutive physical blocks is one slice of it, so nothing is copied to
    be checked. (Chunks of scattered blocks used to be gathered first: a request of 33
    scattered 256 KiB blocks was checked in 8.9 ms against 1.35 for consecutive ones.)
    """

    def __init__(self, pool: npt.NDArray[np.uint8], layout: KvLayout) -> None:
        if not isinstance(pool, np.ndarray) or pool.dtype != np.uint8 or pool.ndim != 1:
            raise LayoutError("pool must be a 1-D uint8 numpy array (a view of the whole pool)")
        if not pool.flags.c_contiguous:
            raise LayoutError("pool must be a contiguous array")
        if pool.size < layout.pool_bytes:
            raise LayoutError(
                f"pool array has {pool.size} bytes, the layout needs {layout.pool_bytes}"
            )
        if not layout.named:
            raise LayoutError(
                f"the reference content needs a block-major or layer-major pool, not {layout.major}"
            )
        self.layout = layout
        nb, r, p = layout.num_blocks, layout.pieces_per_block, layout.piece_bytes
        self.words = p % 8 == 0
        self.unit = _U64 if self.words else np.dtype(np.uint8)
        self.units = p // self.unit.itemsize
        flat = pool[: layout.pool_bytes]
        if layout.major == BLOCK_MAJOR:
            self.bytes = flat.reshape(nb, r, p)
            self.pieces = flat.view(self.unit).reshape(nb, r, self.units)
        else:
            self.bytes = flat.reshape(r, nb, p).transpose(1, 0, 2)
            self.pieces = flat.view(self.unit).reshape(r, nb, self.units).transpose(1, 0, 2)

    def runs(self, ids: npt.NDArray[np.int64]) -> Iterator[tuple[int, int, int]]:
        """(first logical index, first physical id, blocks) of each run of consecutive
        physical ids, none over about _CHUNK_BYTES (so that scratch arrays stay in cache)."""
        step = max(1, _CHUNK_BYTES // self.layout.block_bytes)
        for j, k, first in block_runs(ids, step):
            yield j, first, k - j


def _check_seed(seed: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")


# -- public API ------------------------------------------------------------------------------


def fill_blocks(
    pool: npt.NDArray[np.uint8],
    layout: KvLayout,
    blocks: BlockIds,
    seed: int,
    start: int = 0,
    *,
    tp: TpRank | None = None,
) -> None:
    """Write the content of logical blocks start..start+len(blocks)-1 of the request `seed`
    into the physical blocks `blocks` (all tokens of every block). `start` > 0 fills a later
    part of a request, e.g. one prefill chunk's blocks as that chunk completes. `tp`: the pool
    belongs to that tensor-parallel rank and holds its heads of the content."""
    ids = layout.check_blocks(blocks)
    access = _Pool(pool, layout)
    bases = _bases(seed, start + ids.shape[0], layout.pieces_per_block)[start:]
    ramp = _piece_ramp(layout, tp)
    for j, first, m in access.runs(ids):
        if ramp is not None:
            # Straight into the pool, no temporary.
            np.add(bases[j : j + m, :, None], ramp, out=access.pieces[first : first + m])
        else:  # not whole words: bytes
            access.bytes[first : first + m] = _local_expected(bases[j : j + m], layout, tp)


def clear_blocks(pool: npt.NDArray[np.uint8], layout: KvLayout, blocks: BlockIds) -> None:
    """Zero the physical blocks `blocks` (so a test can prove that data arrived)."""
    ids = layout.check_blocks(blocks)
    access = _Pool(pool, layout)
    for _, first, m in access.runs(ids):
        access.pieces[first : first + m] = 0


def _verified_blocks(layout: KvLayout, blocks: BlockIds, num_tokens: int) -> npt.NDArray[np.int64]:
    """The checked ids of `blocks`, which must be exactly the blocks holding `num_tokens`
    tokens (LayoutError otherwise): what the host and the device verification both require,
    with the same messages."""
    ids = layout.check_blocks(blocks)
    tpb = layout.tokens_per_block
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise LayoutError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
    needed = -(-num_tokens // tpb)
    if ids.shape[0] != needed:
        raise LayoutError(
            f"{num_tokens} tokens at {tpb} tokens per block need {needed} blocks, "
            f"got {ids.shape[0]}"
        )
    return ids


def verify_blocks(
    pool: npt.NDArray[np.uint8],
    layout: KvLayout,
    blocks: BlockIds,
    seed: int,
    num_tokens: int,
    *,
    tp: TpRank | None = None,
) -> VerifyResult:
    """Check every byte of the first `num_tokens` tokens of the request `seed`, stored in the
    physical blocks `blocks` (logical block i in blocks[i]); `tp`: the pool holds that
    tensor-parallel rank's heads of the content.

    `blocks` must be exactly the ceil(num_tokens / tokens_per_block) blocks that hold them; the
    tokens of the last block past num_tokens are not checked. Raises LayoutError when the block
    count does not match. Every checked byte is compared even after a mismatch; the result
    names the first wrong byte in (logical block, layer, kv, token) order.
    """
    ids = _verified_blocks(layout, blocks, num_tokens)
    tpb = layout.tokens_per_block
    access = _Pool(pool, layout)
    bases = _bases(seed, ids.shape[0], layout.pieces_per_block)
    full = num_tokens // tpb  # blocks checked whole; a partial one may follow
    found: _Found | None = None
    ramp = _piece_ramp(layout, tp)

    for j, first, m in access.runs(ids[:full]):
        chunk_bases = bases[j : j + m]
        if ramp is not None:
            hit = _verify_chunk(access.pieces[first : first + m], chunk_bases, ramp)
        else:  # not whole words: bytes
            expected = _local_expected(chunk_bases, layout, tp)
            hit = _verify_chunk_bytes(access.bytes[first : first + m], expected)
        if hit is not None and found is None:
            found = (j + hit[0], *hit[1:])
    checked = full * layout.block_bytes

    tail_tokens = num_tokens - full * tpb
    if tail_tokens:
        nbytes = tail_tokens * layout.token_bytes
        stored = access.bytes[int(ids[full])][:, :nbytes]
        expected = _local_expected(bases[full], layout, tp)[:, :nbytes]
        wrong = stored != expected
        checked += wrong.size
        if found is None and wrong.any():
            r, off = (int(x) for x in np.unravel_index(int(np.argmax(wrong)), wrong.shape))
            found = (full, r, off, int(expected[r, off]), int(stored[r, off]))
    mismatch = None if found is None else _describe(layout, ids, found, tp or TpRank())
    return VerifyResult(ok=found is None, bytes_checked=checked, first_mismatch=mismatch)


# (logical block, region, byte offset in the piece, expected byte, found byte)
_Found = tuple[int, int, int, int, int]


def _verify_chunk_bytes(stored: U8, expected: U8) -> _Found | None:
    """Check the stored bytes of whole blocks (m, regions, piece_bytes) against theirs."""
    m = stored.shape[0]
    wrong = stored != expected
    if not wrong.any():
        return None
    jj, r, off = (int(x) for x in np.unravel_index(int(np.argmax(wrong)), wrong.shape))
    assert jj < m
    return (jj, r, off, int(expected[jj, r, off]), int(stored[jj, r, off]))


def _verify_chunk(stored: npt.NDArray[np.generic], bases: U64, ramp: U64) -> _Found | None:
    """Check the stored pieces of whole blocks (m, regions, words; bases: theirs) of
    whole-word pieces against base + `ramp` (_piece_ramp); the first wrong byte, logical
    index relative to the chunk."""
    m, regions, words = stored.shape
    # A chunk of several blocks is already about _CHUNK_BYTES; one big block is walked a few
    # regions at a time so that the scratch arrays stay in cache.
    step = max(1, min(regions, _CHUNK_BYTES // (8 * words))) if m == 1 else regions
    scratch = np.empty((m, step, words), dtype=np.uint64)
    flags = np.empty((m, step, words), dtype=bool)
    for r0 in range(0, regions, step):
        q = min(step, regions - r0)
        part = stored[:, r0 : r0 + q]
        diff = np.subtract(part, ramp, out=scratch[:, :q])
        wrong = np.not_equal(diff, bases[:, r0 : r0 + q, None], out=flags[:, :q])
        if wrong.any():
            jj, rr, w = (int(x) for x in np.unravel_index(int(np.argmax(wrong)), wrong.shape))
            got = int(part[jj, rr, w])
            want = (int(bases[jj, r0 + rr]) + int(ramp[w])) & 0xFFFF_FFFF_FFFF_FFFF
            # Narrow the wrong word to its first wrong byte (little-endian words).
            x = got ^ want
            # x == 0: the word changed between the vectorised check and this read
            # (a writer is still at work): still a mismatch, report its first byte.
            lsb = ((x & -x).bit_length() - 1) // 8 if x else 0
            return (
                jj,
                r0 + rr,
                w * 8 + lsb,
                (want >> (8 * lsb)) & 0xFF,
                (got >> (8 * lsb)) & 0xFF,
            )
    return None


def _describe(layout: KvLayout, ids: npt.NDArray[np.int64], found: _Found, tp: TpRank) -> str:
    j, region, off, want, got = found
    layer, kv = divmod(region, layout.kv_factor)
    token, byte = divmod(off, layout.token_bytes)
    head_bytes = layout.head_dim * layout.itemsize
    head = tp.rank * layout.num_kv_heads + byte // head_bytes
    where = f"kv head {head} of {layout.num_kv_heads * tp.size}"
    if tp.size > 1:
        where += f", held by {tp}"
    return (
        f"logical block {j} (physical block {int(ids[j])}), layer {layer}, kv {kv}, "
        f"token {token}, byte {byte} of the token ({where}): "
        f"expected 0x{want:02x}, found 0x{got:02x}"
    )

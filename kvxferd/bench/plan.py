"""What every process of a bench run agrees on.

The driver writes one Plan as JSON; the two bench engines (daemon path) and the raw NIXL pair
read it, so they move the same requests between the same blocks in the same order:

* geometry and pool size (both pools of every pair have the same layout);
* per in-flight *slot*, the source and destination block lists (deterministic, from a seed);
  a request of n blocks in slot s uses the first n ids of slot s's lists;
* the request sequence: groups run one after another (a barrier between them); inside a
  group, request j runs in slot j % in_flight, and each slot runs its requests in order, so
  exactly `in_flight` requests are outstanding and two requests never share blocks.

Sweep mode: for each request length, a warm-up group then a timed group. Small mode: one-block
requests, a warm-up group then an open-ended timed group that runs for `seconds`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvxferd.memory.hugepages import HUGE_PAGES_MODES, HugePagesMode
from kvxferd.memory.layout import KvLayout
from kvxferd.sim.cluster import GEOMETRY_FLAGS

SWEEP = "sweep"
SMALL = "small"
# How the bench engines fill and check the KV (Plan.verify): EACH, every request's blocks are
# filled before its send and checked after it arrives; SLOT, as the raw pair does whenever it
# runs several requests at a time: each slot's blocks are filled and zeroed once per group and
# checked at the group's end (every request of a slot carries the same content).
VERIFY_EACH = "each"
VERIFY_SLOT = "slot"
VERIFY_CHOICES = (VERIFY_EACH, VERIFY_SLOT)
WARMUP = "warmup"
TIMED = "timed"

#: The pages of every host pool of a run (engines' and the raw pair's), set by
#: `kvxferd bench --huge-pages` in the environment every process of the run inherits.
HUGE_PAGES_ENV = "KVXFERD_BENCH_HUGE_PAGES"


def pool_huge_pages(default: HugePagesMode = "off") -> HugePagesMode:
    """The run's huge_pages mode for host pools: the driver's (HUGE_PAGES_ENV), else `default`."""
    value = os.environ.get(HUGE_PAGES_ENV, default)
    for mode in HUGE_PAGES_MODES:
        if value == mode:
            return mode
    raise ValueError(f"{HUGE_PAGES_ENV}={value!r}: expected one of {', '.join(HUGE_PAGES_MODES)}")


#: Extra blocks in every pool beyond what the slots use (so that slot lists are a sample of a
#: larger pool, as in an engine's cache).
POOL_SLACK_BLOCKS = 8


@dataclass(frozen=True)
class Geometry:
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    tokens_per_block: int = 32
    dtype: str = "float16"
    layout: str = "block-major"

    def kv_layout(self, num_blocks: int) -> KvLayout:
        """Raises LayoutError when the geometry is invalid."""
        return KvLayout(
            num_layers=self.layers,
            kv_factor=2,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            tokens_per_block=self.tokens_per_block,
            dtype=self.dtype,
            major=self.layout,
            num_blocks=num_blocks,
        )

    @property
    def block_bytes(self) -> int:
        return self.kv_layout(1).block_bytes

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.tokens_per_block)

    def request_bytes(self, tokens: int) -> int:
        """Bytes one request of `tokens` moves: whole blocks, as the daemon writes them."""
        return self.blocks_for(tokens) * self.block_bytes

    def cluster_geometry(self) -> dict[str, Any]:
        """The `engine.kv_layout` section of the daemons' configs (LocalCluster.geometry)."""
        return {key: getattr(self, flag) for flag, key in GEOMETRY_FLAGS.items()}


@dataclass(frozen=True)
class Item:
    """One request: its id, length, slot, and whether it counts."""

    request_id: str
    tokens: int
    blocks: int
    slot: int
    timed: bool


@dataclass(frozen=True)
class Group:
    """Requests run together; the next group starts when all of these finished.

    `count` None: open-ended (small mode's timed group): each slot keeps going until the
    generation side (or the raw initiator) stops it.
    """

    key: str
    tokens: int
    blocks: int
    phase: str
    count: int | None

    @property
    def timed(self) -> bool:
        return self.phase == TIMED

    def slot_seed(self, slot: int) -> int:
        """The content seed of `slot`'s blocks when a slot is filled once per group (the raw
        pair with several requests in flight; the engines with --verify slot)."""
        from kvxferd.sim.content import request_seed

        return request_seed(f"{self.key}-slot{slot}")

    def slot_item(self, slot: int) -> Item:
        """A stand-in for every request of `slot` in this group (they share its blocks:
        Plan.src_for and dst_for), named after the slot."""
        return Item(f"{self.key}-slot{slot}", self.tokens, self.blocks, slot, self.timed)

    def slot_items(self, slot: int, in_flight: int) -> Iterator[Item]:
        """The requests of this group that run in `slot`, in order."""
        js: Iterator[int] = (
            itertools.count(slot, in_flight)
            if self.count is None
            else iter(range(slot, self.count, in_flight))
        )
        for j in js:
            yield Item(f"{self.key}-{j}", self.tokens, self.blocks, slot, self.timed)


@dataclass
class Plan:
    mode: str
    geometry: Geometry
    lengths: list[int]
    requests: int
    warmup: int
    in_flight: int
    seconds: float
    pool_blocks: int
    run_id: str
    src_blocks: list[list[int]] = field(default_factory=list)
    dst_blocks: list[list[int]] = field(default_factory=list)
    verify: str = VERIFY_EACH

    @classmethod
    def build(
        cls,
        *,
        mode: str,
        geometry: Geometry,
        lengths: list[int],
        requests: int,
        warmup: int,
        in_flight: int,
        seconds: float,
        run_id: str,
        seed: int = 1,
        shuffle: bool = True,
        verify: str = VERIFY_EACH,
    ) -> Plan:
        if verify not in VERIFY_CHOICES:
            raise ValueError(f"verify must be one of {VERIFY_CHOICES}, got {verify!r}")
        if mode == SMALL:
            lengths = [geometry.tokens_per_block]
        per_slot = max(geometry.blocks_for(t) for t in lengths)
        used = per_slot * in_flight
        pool_blocks = used + POOL_SLACK_BLOCKS
        rng = np.random.default_rng(seed)

        def slot_lists() -> list[list[int]]:
            ids = rng.permutation(pool_blocks)[:used] if shuffle else np.arange(used)
            return [ids[s * per_slot : (s + 1) * per_slot].tolist() for s in range(in_flight)]

        return cls(
            mode=mode,
            geometry=geometry,
            lengths=list(lengths),
            requests=requests,
            warmup=warmup,
            in_flight=in_flight,
            seconds=seconds,
            pool_blocks=pool_blocks,
            run_id=run_id,
            src_blocks=slot_lists(),
            dst_blocks=slot_lists(),
            verify=verify,
        )

    def layout(self) -> KvLayout:
        return self.geometry.kv_layout(self.pool_blocks)

    def groups(self) -> list[Group]:
        out: list[Group] = []
        for tokens in self.lengths:
            blocks = self.geometry.blocks_for(tokens)
            base = f"{self.run_id}-{tokens}"
            if self.warmup:
                out.append(Group(f"{base}-w", tokens, blocks, WARMUP, self.warmup))
            timed_count = None if self.mode == SMALL else self.requests
            out.append(Group(f"{base}-t", tokens, blocks, TIMED, timed_count))
        return out

    def start_group(self, group: Group, timed_start_ns: int) -> tuple[float | None, int]:
        """At the start of `group`: (when its slots stop, the start of the timed part).

        An open-ended group runs `seconds` from now, and its time starts now; any other
        group has no deadline, and the first timed one starts the time (monotonic ns) unless
        `timed_start_ns` already did."""
        if group.count is None:
            started = time.monotonic_ns()
            return time.monotonic() + self.seconds, started
        if group.timed and not timed_start_ns:
            return None, time.monotonic_ns()
        return None, timed_start_ns

    def src_for(self, item: Item) -> list[int]:
        return self.src_blocks[item.slot][: item.blocks]

    def dst_for(self, item: Item) -> list[int]:
        return self.dst_blocks[item.slot][: item.blocks]

    # -- files -------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def save(self, path: Path) -> None:
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Path | str) -> Plan:
        d = json.loads(Path(path).read_text())
        d["geometry"] = Geometry(**d["geometry"])
        return cls(**d)

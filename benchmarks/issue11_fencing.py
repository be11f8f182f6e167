"""Issue 11, measured: a writer stopped mid-write, its receive failing, the blocks reused.

For each configuration and each pass: three daemons (ctx1, ctx2, gen) on loopback; the
generation engine asks ctx1 for a scattered 3,000-block request; as soon as its first
destination bytes land, ctx1 is stopped (SIGSTOP) or killed (SIGKILL). Then the numbers
issue 11 asks about:

- how late the failure outcome came, past the receive's kv_transfer_timeout_ms (the
  promise: within one heartbeat interval);
- whether the blocks were reported held, and how long the hold lasted (SIGSTOP: it ends
  only after SIGCONT; SIGKILL: the pidfd shows the death at once);
- how many of the held blocks the resumed writer wrote *after* the outcome (the late
  writes fencing exists for; 0 means the stall was not mid-write);
- whether the blocks, reused for a request from ctx2 once released, still verify after
  the resumed writer settled (corrupted must be 0).

Usage: .venv/bin/python benchmarks/issue11_fencing.py [--passes N] [--configs ...] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvxferd.client import AsyncClient
from kvxferd.memory.layout import KvLayout
from kvxferd.memory.memfd import MemfdRegion
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.content import clear_blocks, fill_blocks, request_seed, verify_blocks
from kvxferd.sim.workload import BlockAllocator

TPB = 32
BIG = 3000
TIMEOUT_MS = 2000
HEARTBEAT_MS = 300
CONFIGS = {
    "nixl-python": {"backend": "NIXL", "transceiver_runtime": "PYTHON"},
    "nixl-cpp": {"backend": "NIXL", "transceiver_runtime": "CPP", "max_tokens_in_buffer": 64},
    "mooncake-cpp": {
        "backend": "MOONCAKE",
        "transceiver_runtime": "CPP",
        "max_tokens_in_buffer": 64,
    },
    "ucx-cpp": {"backend": "UCX", "transceiver_runtime": "CPP", "max_tokens_in_buffer": 64},
    "mpi-cpp": {"backend": "MPI", "transceiver_runtime": "CPP", "max_tokens_in_buffer": 64},
}


def layout() -> KvLayout:
    return KvLayout(
        num_layers=2, kv_factor=2, num_kv_heads=1, head_dim=8, tokens_per_block=TPB,
        dtype="float16", major="block-major", num_blocks=8000,
    )  # fmt: skip


class Engine:
    def __init__(self, client: AsyncClient, region: MemfdRegion) -> None:
        self.client, self.region, self.layout = client, region, layout()
        self.alloc = BlockAllocator(self.layout.num_blocks)
        self.alloc.shuffle(7)  # scattered: one descriptor a block

    @classmethod
    async def open(cls, d: DaemonProc) -> Engine:
        client = await AsyncClient.connect(d.api_socket, engine=f"bench-{d.name}")
        region = MemfdRegion.create(layout().pool_bytes)
        await client.register_pool("pool0", region, layout())
        return cls(client, region)

    @property
    def pool(self) -> Any:
        return self.region.array

    def written(self, blocks: list[int]) -> int:
        size = self.layout.block_bytes
        view = self.pool[: self.layout.num_blocks * size].reshape(self.layout.num_blocks, size)
        return int(view[blocks].any(axis=1).sum())


def status(d: DaemonProc) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{d.http_address}/v1/status", timeout=10) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


async def until(pred: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(pred):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s")
        await asyncio.sleep(0.02)


async def start(c: Engine, ctx: DaemonProc, g: Engine, rid: str, blocks: list[int]) -> list[int]:
    """`g` asks `ctx` for `rid` into `blocks` (cleared first); `c` sends it from blocks of
    its own, filled with the request's content: those blocks."""
    tokens = len(blocks) * TPB
    clear_blocks(g.pool, g.layout, blocks)
    await g.client.recv(rid, "pool0", blocks, ctx.peer_address, tokens)
    mine = c.alloc.take(len(blocks))
    fill_blocks(c.pool, c.layout, mine, request_seed(rid))
    await c.client.send(rid, "pool0", mine, tokens)
    return mine


async def serve(c: Engine, ctx: DaemonProc, g: Engine, rid: str, blocks: list[int]) -> None:
    mine = await start(c, ctx, g, rid, blocks)
    got, sent = await g.client.wait(rid, 30), await c.client.wait(rid, 30)
    c.alloc.give(mine)
    if (got.status, sent.status) != ("done", "done"):
        raise RuntimeError(f"{rid}: {got} / {sent}")
    await g.client.release(rid)
    await c.client.release(rid)


async def one_pass(workdir: Path, config: dict[str, Any], sig: int) -> dict[str, Any]:
    cfg = {
        "transceiver": {**config, "kv_transfer_timeout_ms": TIMEOUT_MS},
        "daemon": {"heartbeat_interval_ms": HEARTBEAT_MS, "heartbeat_timeout_ms": 5 * HEARTBEAT_MS},
    }
    with LocalCluster(workdir) as cluster:
        ctx1 = cluster.start_daemon("ctx1", "context", **cfg)
        ctx2 = cluster.start_daemon("ctx2", "context", **cfg)
        gen = cluster.start_daemon("gen", "generation", **cfg)
        c1, c2, g = await Engine.open(ctx1), await Engine.open(ctx2), await Engine.open(gen)
        blocks = g.alloc.take(BIG)
        clear_blocks(g.pool, g.layout, blocks)
        await g.client.recv("big", "pool0", blocks, ctx1.peer_address, BIG * TPB)
        await until(lambda: status(ctx1)["sessions"]["send"] == {"ready": 1})
        src = c1.alloc.take(BIG)
        fill_blocks(c1.pool, c1.layout, src, request_seed("big"))
        (o0, n0), (o1, n1) = g.layout.block_segments(blocks)[[0, -1]]
        first, last = g.pool[int(o0) : int(o0 + n0)], g.pool[int(o1) : int(o1 + n1)]
        await c1.client.send("big", "pool0", src, BIG * TPB)

        def spin() -> bool:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if first.any():
                    os.kill(ctx1.proc.pid, sig)
                    return not last.any()
            raise TimeoutError("the write never started")

        cut = await asyncio.to_thread(spin)
        o = await g.client.wait("big", 30)
        at_outcome = g.written(blocks)
        row: dict[str, Any] = {
            "cut_mid_write": cut,
            "status": o.status,
            "outcome_minus_deadline_ms": round(o.elapsed_ms - TIMEOUT_MS, 1),
            "blocks_held": o.blocks_held,
            "quarantined_bytes": status(gen)["holds"]["reservation_bytes"],
        }
        t_held = time.monotonic()
        if not o.blocks_held:
            await serve(c2, ctx2, g, "reuse", blocks)  # the engine may reuse them at once
        if sig == signal.SIGSTOP:
            await asyncio.sleep(1.0)  # the stall goes on: nothing may be released meanwhile
            row["released_while_stopped"] = g.client.released("big") is not None
            ctx1.kill(signal.SIGCONT)
        if o.blocks_held:
            rel = await g.client.wait_released("big", 60)
            row["hold_s"] = round(time.monotonic() - t_held, 2)
            row["fence"] = rel.how
            row["late_written_blocks"] = g.written(blocks) - at_outcome
            await g.client.release("big")
            await serve(c2, ctx2, g, "reuse", blocks)
        if sig == signal.SIGSTOP:
            await until(lambda: status(ctx1)["open_transfer_handles"] == 0)
            await until(lambda: status(gen)["holds"]["requests"] == 0)
        result = verify_blocks(g.pool, g.layout, blocks, request_seed("reuse"), BIG * TPB)
        row["reused_blocks_corrupted"] = not result.ok
        for e in (c1, c2, g):
            await e.client.close()
            e.region.close()
    return row


def summarize(name: str, sig: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    over = [r["outcome_minus_deadline_ms"] for r in rows]
    return {
        "config": name,
        "signal": sig,
        "passes": len(rows),
        "cut_mid_write": sum(r["cut_mid_write"] for r in rows),
        "outcome_minus_deadline_ms_p50": round(statistics.median(over), 1),
        "outcome_minus_deadline_ms_max": max(over),
        "held": sum(r["blocks_held"] for r in rows),
        "quarantined": sum(r["quarantined_bytes"] > 0 for r in rows),
        "released_while_stopped": sum(r.get("released_while_stopped", False) for r in rows),
        "late_written_blocks": sum(r.get("late_written_blocks", 0) for r in rows),
        "fences": sorted({r["fence"] for r in rows if "fence" in r}),
        "corrupted": sum(r["reused_blocks_corrupted"] for r in rows),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = []
    for name in args.configs.split(","):
        sigs = [("SIGSTOP", signal.SIGSTOP)] + (
            [("SIGKILL", signal.SIGKILL)] if name == "nixl-python" else []
        )
        for label, sig in sigs:
            rows = []
            for i in range(args.passes):
                with tempfile.TemporaryDirectory(prefix="kvxferd-issue11-") as tmp:
                    rows.append(asyncio.run(one_pass(Path(tmp), CONFIGS[name], sig)))
                print(f"{name} {label} pass {i + 1}: {rows[-1]}", file=sys.stderr)
            out.append(summarize(name, label, rows))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        cols = list(out[0])
        print(" | ".join(cols))
        for row in out:
            print(" | ".join(str(row[c]) for c in cols))
    return 1 if any(r["corrupted"] for r in out) else 0


if __name__ == "__main__":
    sys.exit(main())

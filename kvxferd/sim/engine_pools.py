"""Where a reference engine's pools live and how they reach the daemon: host or device
memory, the command-line options that choose them and the pools' geometry, and the content
calls for host pools. Shared by the reference engine (engine.py, reference_engine.py) and
the bench's engines and raw NIXL pair (kvxferd.bench)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvxferd.memory.heads import TpRank
from kvxferd.memory.hugepages import HUGE_PAGES_MODES
from kvxferd.memory.layout import KvLayout
from kvxferd.sim.content import clear_blocks, fill_blocks, verify_blocks

if TYPE_CHECKING:
    from kvxferd.client import AsyncClient
    from kvxferd.memory.device import DevicePool

#: Where the reference engine keeps its pools (--memory) and how a device pool is shared.
MEMORY = ("host", "vram")
VRAM_SHARE = ("ipc", "vmm")


class HostContent:
    """The reference content of host pools (kvxferd.sim.content), behind the same four
    calls as kvxferd.sim.device_content.DeviceContent; nothing to synchronise."""

    # The content functions themselves: a host pool needs no device or stream around them.
    fill = staticmethod(fill_blocks)
    clear = staticmethod(clear_blocks)
    verify = staticmethod(verify_blocks)

    @staticmethod
    def synchronize() -> None:
        pass


async def register_device_pool(
    client: AsyncClient, pool_id: str, pool: DevicePool, layout: KvLayout, tp: TpRank
) -> None:
    """Register a device pool with its daemon: by its VMM fd when it was created with
    vmm=True, else by its CUDA IPC handle (the client chooses by the pool)."""
    await client.register_device_pool(pool_id, pool, layout, tp.rank, tp.size)


def layout_from_args(args: argparse.Namespace, ranks: int = 1) -> KvLayout:
    """Each rank's pool: `--kv-heads` are the model's, split evenly over `ranks`."""
    if args.kv_heads % ranks:
        raise SystemExit(
            f"--kv-heads {args.kv_heads} cannot be split evenly over {ranks} tensor-parallel ranks"
        )
    return KvLayout(
        num_layers=args.layers,
        kv_factor=2,
        num_kv_heads=args.kv_heads // ranks,
        head_dim=args.head_dim,
        tokens_per_block=args.tokens_per_block,
        dtype=args.dtype,
        major=args.layout,
        num_blocks=args.pool_blocks,
    )


def add_memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--memory",
        choices=MEMORY,
        default="host",
        help="where each rank's KV pool lives: host (shared memory) or vram (GPU memory; "
        "needs cupy and a CUDA device, and daemons with engine.kv_memory: vram)",
    )
    p.add_argument(
        "--vram-share",
        choices=VRAM_SHARE,
        default="ipc",
        help="vram: hand the pool to the daemon as a CUDA IPC handle or a VMM fd",
    )
    p.add_argument(
        "--cuda-device", type=int, default=0, help="vram: this process's CUDA device ordinal"
    )
    p.add_argument(
        "--huge-pages",
        choices=HUGE_PAGES_MODES,
        default="off",
        help="host: the pool's pages; auto takes huge pages where the host allows them, "
        "required fails where it does not (kvxferd.memory.hugepages)",
    )


def add_geometry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=8)
    p.add_argument(
        "--kv-heads", type=int, default=4, help="the model's KV heads (split over the ranks)"
    )
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--layout", choices=["block-major", "layer-major"], default="block-major")

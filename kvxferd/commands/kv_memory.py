"""The --memory and --vram-share options that `kvxferd bench` and `kvxferd demo` share."""

from __future__ import annotations

import argparse


def add_kv_memory_args(p: argparse._ActionsContainer, memory_help: str) -> None:
    """Add --memory (host or vram; `memory_help` says what it means to the command) and
    --vram-share (how a vram pool reaches its daemon) to the parser or group `p`."""
    p.add_argument("--memory", choices=["host", "vram"], default="host", help=memory_help)
    p.add_argument(
        "--vram-share",
        choices=["ipc", "vmm"],
        default="ipc",
        help="--memory vram: share each pool with its daemon as a CUDA IPC handle or VMM fd",
    )

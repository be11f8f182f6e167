"""A careless context engine: sends nobody asks for, posted as fast as the client goes.

Prints the context daemon's resident memory before and after, and how many sends were
refused (`too_many_requests`, daemon.max_requests). Before the limit, 100,000 such sends
grew the daemon by 314 MiB and nothing was refused; memory grew for as long as the
engine posted (each send waits kv_transfer_timeout_ms, 60 s by default, for a receiver).

    python benchmarks/careless_engine_flood.py [--sends 100000] [--max-requests N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvxferd.client import Client
from kvxferd.memory.layout import KvLayout
from kvxferd.memory.memfd import MemfdRegion
from kvxferd.sim.cluster import LocalCluster

BLOCKS = 64


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sends", type=int, default=100_000)
    ap.add_argument("--max-requests", type=int, default=None, help="daemon.max_requests")
    args = ap.parse_args()
    daemon = {} if args.max_requests is None else {"max_requests": args.max_requests}
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(Path(tmp)) as c:
        ctx = c.start_daemon(
            "ctx", "context", transceiver={"kv_transfer_timeout_ms": 600_000}, daemon=daemon
        )
        g = c.geometry  # no helper from kvxferd: the script also runs older trees (PYTHONPATH)
        layout = KvLayout(
            num_layers=g["num_layers"], kv_factor=2, num_kv_heads=g["num_kv_heads"],
            head_dim=g["head_dim"], tokens_per_block=g["tokens_per_block"], dtype=g["dtype"],
            major=g["layout"], num_blocks=BLOCKS,
        )  # fmt: skip
        region = MemfdRegion.create(layout.pool_bytes, "careless-flood")
        with Client(ctx.api_socket, engine="careless") as client:
            client.register_pool("p", region, layout)
            before = rss_mib(ctx.proc.pid)
            t0 = time.monotonic()
            started = []
            for i in range(args.sends):
                started.append(client.start_send(f"r{i}", "p", [i % BLOCKS], 16))
                if i % 20_000 == 0:
                    client.flush(60)  # bounds what waits in the client's own queue
            client.flush(60)
            posted_s = time.monotonic() - t0
            time.sleep(2.0)  # the daemon's last replies (a refusal fails its future)
            refused = sum(
                1
                for f in started
                if f.done() and f.exception() is not None and "too_many" in str(f.exception())
            )
            after = rss_mib(ctx.proc.pid)
        region.close()
        print(
            f"sends {args.sends} posted in {posted_s:.1f} s; context daemon RSS {before} -> "
            f"{after} MiB; refused too_many_requests: {refused}; "
            f"kept: {args.sends - refused}"
        )


if __name__ == "__main__":
    main()

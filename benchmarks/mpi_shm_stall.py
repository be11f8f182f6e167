"""A context daemon stopped or killed inside UCX's send: does it hold up the MPI transfers
of the other context daemons to the same generation daemon?

UCX's shared-memory transports (posix/sysv "mm") give each process one receive queue that
every sender on the host writes into, in order: a sender claims the next slot, copies its
message in, then marks the slot written, and the receiver reads slots in order. This stops
a sender between the two on purpose instead of hoping a random SIGSTOP lands there: gdb
attaches to ctx1, breaks at UCX's `am_bcopy` send of that transport, steps into the pack
callback the send was given (the slot is claimed, not yet marked), and leaves ctx1 there
stopped. Then ctx2 serves a request to the same generation daemon while ctx1 stays stopped
(or after it was killed), and once more after ctx1 is resumed.

Three daemons on loopback (staged runtime over MPI, 512 KiB staging regions); `--tcp-device`
also runs the scenario with UCX_TLS=tcp over that network device, where each peer has a
connection of its own.

How the generation daemon reports it (MPI link keepalives, kvxferd/backends/mpi/keepalive.py):
its readiness (/v1/status "ready", as /readyz) and the peers it names stalled, how long
after ctx1 was stopped or killed it turned not ready, and after ctx1 resumed; and its
health (/healthz): after a kill, how long until it asked for a restart (503, once the
stall lasted daemon.stall_unhealthy_s, 20 s here), and with ctx1 stopped for less than
that, still healthy.

Usage: .venv/bin/python benchmarks/mpi_shm_stall.py [--tcp-device eth0] [--modes stop kill]
Needs gdb. docs/backends-mpi.md, "A peer stopped or killed inside a shared-memory send".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from issue11_fencing import BIG, TPB, Engine, start, status, until

from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.content import clear_blocks, fill_blocks, request_seed

CONFIG = {
    "transceiver": {
        "backend": "MPI",
        "transceiver_runtime": "CPP",
        "max_tokens_in_buffer": 64,
        "kv_transfer_timeout_ms": 3000,
    },
    # A stall this long makes the daemon unhealthy (/healthz 503): shorter than the default
    # minute, longer than the stop mode's stop (about 11 s), so only a kill reaches it.
    "daemon": {"heartbeat_interval_ms": 300, "heartbeat_timeout_ms": 1500, "stall_unhealthy_s": 20},
}
# Where ctx1 is stopped: inside a payload's send (a bcopy or zcopy one: the link's
# keepalives, 24-byte headers, go as am_short and would stop it before the request).
# Shared memory: in the pack callback UCX's am_bcopy send was given
# (x86-64: its third argument), after the slot was claimed and before it is marked. TCP:
# at the entry of one of its bcopy or zcopy sends (a message of several segments may be
# half sent by then); each connection has buffers of its own.
STOP_AT = {
    "shm": ["break uct_mm_ep_am_bcopy", "echo ARMED\\n", "continue", "tbreak *$rdx", "delete 1"],
    "tcp": ["rbreak ^uct_tcp_ep_am_[bz]copy", "echo ARMED\\n"],
}


def stop_inside_send(pid: int, transport: str) -> subprocess.Popen[str]:
    """gdb on `pid`, armed: stopped inside UCX's next send over `transport` (STOP_AT), then
    SIGSTOPped and detached (it stays stopped there). Returns once the breakpoint is set."""
    cmds = [
        "set pagination off",
        *STOP_AT[transport],
        "continue",
        "bt 4",
        f"shell kill -STOP {pid}",
        "detach",
        "quit",
    ]
    args = ["gdb", "-p", str(pid), "-batch", "-nx"] + [a for c in cmds for a in ("-ex", c)]
    gdb = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert gdb.stdout is not None
    for line in gdb.stdout:
        if "ARMED" in line:
            return gdb
    raise RuntimeError(f"gdb could not break inside a {transport} send of {pid}")


async def transfer(c: Engine, ctx: DaemonProc, g: Engine, rid: str, blocks: list[int]) -> str:
    """One request from `ctx` into `blocks`: its receive's outcome and how long it took."""
    t0 = time.monotonic()
    mine = await start(c, ctx, g, rid, blocks)
    got = await g.client.wait(rid, 30)
    took = time.monotonic() - t0
    c.alloc.give(mine)
    await g.client.release(rid)
    return f"{got.status}/{got.reason} in {took:.2f} s"


def readiness(d: DaemonProc) -> str:
    """The daemon's /readyz word and the peers it reports stalled (keepalive.py)."""
    doc = status(d)
    stalled = ", ".join(f"{k.split('/')[0]} {v:.0f} s" for k, v in doc["stalled_peers"].items())
    word = "ready" if doc["ready"] else "NOT ready"
    return word + (f" (stalled: {stalled})" if stalled else "")


async def watch_readiness(d: DaemonProc, since: float, want_ready: bool, limit_s: float) -> str:
    """How long after `since` the daemon's readiness became `want_ready`, and what it said."""
    try:
        await until(lambda: status(d)["ready"] is want_ready, limit_s)
    except TimeoutError:
        return f"{readiness(d)} still, {time.monotonic() - since:.1f} s on"
    return f"{readiness(d)} {time.monotonic() - since:.1f} s on"


def health(d: DaemonProc) -> str:
    """/healthz's status code and first line of detail."""
    try:
        with urllib.request.urlopen(f"http://{d.http_address}/healthz", timeout=10) as resp:
            return f"{resp.status} {resp.read().decode().strip()}"
    except urllib.error.HTTPError as exc:
        body = exc.read().decode().splitlines()
        return f"{exc.code} {body[0]}: {body[1] if len(body) > 1 else ''}"


async def watch_health(d: DaemonProc, since: float, limit_s: float) -> str:
    """How long after `since` /healthz turned 503, and what it said."""
    try:
        await until(lambda: health(d).startswith("503"), limit_s)
    except TimeoutError:
        return f"{health(d)} still, {time.monotonic() - since:.1f} s on"
    return f"{health(d)}, {time.monotonic() - since:.1f} s on"


async def scenario(workdir: Path, transport: str, mode: str) -> dict[str, Any]:
    with LocalCluster(workdir) as cluster:
        ctx1 = cluster.start_daemon("ctx1", "context", **CONFIG)
        ctx2 = cluster.start_daemon("ctx2", "context", **CONFIG)
        gen = cluster.start_daemon("gen", "generation", **CONFIG)
        c1, c2, g = await Engine.open(ctx1), await Engine.open(ctx2), await Engine.open(gen)
        big, other = g.alloc.take(BIG), g.alloc.take(200)
        row: dict[str, Any] = {"transport": transport, "mode": mode}
        row["before"] = await transfer(c2, ctx2, g, "before", other)
        clear_blocks(g.pool, g.layout, big)
        await g.client.recv("big", "pool0", big, ctx1.peer_address, BIG * TPB)
        await until(lambda: status(ctx1)["sessions"]["send"] == {"ready": 1})
        gdb = await asyncio.to_thread(stop_inside_send, ctx1.proc.pid, transport)
        src = c1.alloc.take(BIG)
        fill_blocks(c1.pool, c1.layout, src, request_seed("big"))
        await c1.client.send("big", "pool0", src, BIG * TPB)
        out = await asyncio.to_thread(lambda: gdb.communicate(timeout=60)[0])
        frames = [line.split(" in ", 1)[-1].split(" (")[0] for line in out.splitlines()]
        ucx = [f for f in frames if f.startswith(("uct_", "ucp_"))]
        row["stopped_in"] = " <- ".join(f for i, f in enumerate(ucx) if ucx[i - 1 : i] != [f])
        wedged = time.monotonic()
        if mode == "kill":
            ctx1.kill(signal.SIGKILL)
        row["big"] = (await g.client.wait("big", 15)).reason
        await g.client.release("big")
        row["during"] = await transfer(c2, ctx2, g, "during", other)
        row["gen_noticed"] = await watch_readiness(gen, wedged, False, 20)
        if mode == "stop":
            resumed = time.monotonic()
            ctx1.kill(signal.SIGCONT)
            row["gen_after"] = await watch_readiness(gen, resumed, True, 20)
        row["after"] = await transfer(c2, ctx2, g, "after", other)
        if mode == "kill":
            row["gen_after"] = readiness(gen)
            row["gen_health"] = await watch_health(gen, wedged, 40)
        else:
            row["gen_health"] = health(gen)
        row["gen_alive"] = gen.alive()
        return row


WHILE = {"stop": "stopped", "kill": "killed"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["stop", "kill"], choices=["stop", "kill"])
    ap.add_argument("--tcp-device", help="also run with UCX_TLS=tcp over this device")
    args = ap.parse_args()
    runs = [("shm", {})]
    if args.tcp_device:
        runs.append(("tcp", {"UCX_TLS": "tcp", "UCX_NET_DEVICES": args.tcp_device}))
    base = Path(tempfile.mkdtemp(prefix="kvxferd-mpi-stall-"))
    for transport, env in runs:
        for mode in args.modes:
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # the daemons inherit it
            try:
                row = asyncio.run(scenario(base / f"{transport}-{mode}", transport, mode))
            finally:
                for k, v in saved.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            print(
                f"{transport:4} ctx1 {mode:4} | stopped in {row['stopped_in']} | ctx1's "
                f"request: {row['big']} | ctx2 before: {row['before']}; with ctx1 "
                f"{WHILE[mode]}: {row['during']}; after: {row['after']} | gen alive: "
                f"{row['gen_alive']} | gen with ctx1 {WHILE[mode]}: {row['gen_noticed']}; "
                f"{'after ctx1 resumed' if mode == 'stop' else 'at the end'}: "
                f"{row['gen_after']} | gen's /healthz: {row['gen_health']}",
                flush=True,
            )
    print(f"daemon logs under {base}")


if __name__ == "__main__":
    main()

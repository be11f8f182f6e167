"""Issue 16, small requests: what the four-process design moves on this host with none of
kvxferd's own work, beside kvxferd and the bare NIXL pair in the same minutes.

The skeleton has the daemon path's processes and hops and nothing else: a context engine,
a context daemon, a generation daemon and a generation engine, each a uvloop process; the
engines talk to their daemons over Unix sockets, the daemons to each other over TCP
loopback (TCP_NODELAY), all in kvxferd's own frames (FrameCodec, CorkedWriter). Per
one-block request (32 KiB, as `kvxferd bench --small`): the generation engine asks its
daemon (Recv), which sends the block's address to the context daemon (RequestData); the
context engine asks its daemon (Send); once both are there the context daemon writes the
block with kvxferd's NixlBackend (prepared lists, posted and polled on its loop) and tells
the generation daemon (Result) and its engine (Done); the generation daemon tells its
engine (Done). The generation engine keeps --in-flight requests going and the context
engine sends each as it is named; neither does content work (the bench's engines fill and
check blocks), so this is an upper bound for the design.

Each pass runs the skeleton and then `kvxferd bench --configs nixl-python --small` (its bare
pair and kvxferd) with the same block size and in-flight count. Reported per pass and as
medians: requests/s of each, each over the bench's bare rate, and the CPU milliseconds per
request of the skeleton's four processes and of kvxferd's (daemons + engines), of the two
daemons alone, and the p50 latency of the bare pair, the skeleton and kvxferd. The skeleton's
latency is the bench's: the generation engine asks first and names the request to the
context engine over a pipe, which takes the time just before its send; the request ends when
the generation engine reads its done (one monotonic clock for all processes).

    .venv/bin/python benchmarks/issue16_small_skeleton.py --passes 3 [--in-flight 1 32]
        [--seconds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec
import numpy as np
import uvloop
from checkouts import cell, stat
from issue16_small import bench

from kvxferd.peers.framing import CorkedWriter, FrameCodec

BLOCK = 32 << 10  # `kvxferd bench --small --layers 2 --kv-heads 2 --head-dim 64`
BLOCKS = 256


class Frame(msgspec.Struct, tag="f"):
    kind: str  # recv, send, data (RequestData), result, done
    rid: str
    block: int = 0
    addr: int = 0


CODEC: FrameCodec[Frame] = FrameCodec(Frame, "skeleton")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _window(start: float, end: float, count: list[int] | None = None) -> dict[str, float]:
    """This process's CPU (and `count[0]`) between the wall-clock times `start` and `end`."""
    await asyncio.sleep(max(0.0, start - time.time()))
    cpu0, n0 = _cpu_s(), count[0] if count else 0
    await asyncio.sleep(max(0.0, end - time.time()))
    return {"cpu_s": _cpu_s() - cpu0, "count": (count[0] - n0) if count else 0}


def _nixl(name: str) -> tuple[Any, np.ndarray]:
    from kvxferd.backends.nixl import NixlBackend

    backend = NixlBackend(name)
    pool = np.ones(BLOCKS * BLOCK, dtype=np.uint8)
    backend.register(int(pool.ctypes.data), pool.nbytes)
    return backend, pool


async def ctx_daemon(args: argparse.Namespace) -> None:
    from kvxferd.backends.base import XferStatus

    backend, pool = _nixl("skeleton-ctx")
    base = int(pool.ctypes.data)
    sends: dict[str, int] = {}  # rid -> our block
    datas: dict[str, int] = {}  # rid -> the receiver's address
    state: dict[str, Any] = {}
    peer_ready = asyncio.get_running_loop().create_future()

    polling: set[asyncio.Task[None]] = set()

    def done(rid: str) -> None:
        state["gen"].write(CODEC.encode(Frame("result", rid)))
        state["eng"].write(CODEC.encode(Frame("done", rid)))

    async def poll(rid: str, handle: Any) -> None:
        while backend.poll(handle) is XferStatus.IN_PROGRESS:
            await asyncio.sleep(0.0001)
        backend.release(handle)
        done(rid)

    def write(rid: str, block: int, addr: int) -> None:
        local = np.array([[base + block * BLOCK, BLOCK]], dtype=np.int64)
        remote = np.array([[addr, BLOCK]], dtype=np.int64)
        handle, status = backend.post_write(
            local, remote, state["peer"], remote_regions=state["regions"]
        )
        if status is XferStatus.IN_PROGRESS:  # rare over shared memory: done in the post
            task = asyncio.ensure_future(poll(rid, handle))
            polling.add(task)
            task.add_done_callback(polling.discard)
            return
        backend.release(handle)
        done(rid)

    def match(rid: str) -> None:
        if rid in sends and rid in datas:
            write(rid, sends.pop(rid), datas.pop(rid))

    async def on_gen(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = json.loads(await r.readline())
        state["peer"] = backend.add_peer(base64.b64decode(hello["metadata"]))
        backend.connect(state["peer"])
        state["regions"] = ((hello["base"], BLOCKS * BLOCK),)
        state["gen"] = CorkedWriter(w)
        peer_ready.set_result(None)
        with contextlib.suppress(asyncio.CancelledError):  # the server closing at the end
            while (f := await CODEC.read(r)) is not None:
                datas[f.rid] = f.addr
                match(f.rid)

    async def on_engine(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        state["eng"] = CorkedWriter(w)
        while (f := await CODEC.read(r)) is not None:
            sends[f.rid] = f.block
            match(f.rid)
        state["eng_closed"].set_result(None)

    state["eng_closed"] = asyncio.get_running_loop().create_future()
    tcp = await asyncio.start_server(on_gen, "127.0.0.1", 0)
    unix = await asyncio.start_unix_server(on_engine, args.sock)
    print(json.dumps({"port": tcp.sockets[0].getsockname()[1]}), flush=True)
    await peer_ready
    window = asyncio.ensure_future(_window(args.start, args.end))
    await state["eng_closed"]
    print(json.dumps(await window), flush=True)
    tcp.close()
    unix.close()


async def gen_daemon(args: argparse.Namespace) -> None:
    backend, pool = _nixl("skeleton-gen")
    base = int(pool.ctypes.data)
    r, w = await asyncio.open_connection("127.0.0.1", args.port)
    w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    w.write((json.dumps({"metadata": base64.b64encode(backend.metadata()).decode(),
                         "base": base}) + "\n").encode())  # fmt: skip
    to_ctx = CorkedWriter(w)
    engine: dict[str, CorkedWriter] = {}
    closed = asyncio.get_running_loop().create_future()

    async def on_engine(er: asyncio.StreamReader, ew: asyncio.StreamWriter) -> None:
        engine["w"] = CorkedWriter(ew)
        while (f := await CODEC.read(er)) is not None:
            to_ctx.write(CODEC.encode(Frame("data", f.rid, addr=base + f.block * BLOCK)))
        closed.set_result(None)

    async def from_ctx() -> None:
        while (f := await CODEC.read(r)) is not None:
            engine["w"].write(CODEC.encode(Frame("done", f.rid)))

    unix = await asyncio.start_unix_server(on_engine, args.sock)
    print(json.dumps({"ready": True}), flush=True)
    reader = asyncio.ensure_future(from_ctx())
    window = asyncio.ensure_future(_window(args.start, args.end))
    await closed
    print(json.dumps(await window), flush=True)
    reader.cancel()
    to_ctx.close()
    unix.close()


async def _engine_end(
    times: str,
    stamps: dict[str, int],
    window: asyncio.Future[dict[str, float]],
    reader: asyncio.Future[None],
    out: CorkedWriter,
) -> None:
    """An engine's last steps: its time stamps to `times`, its report on stdout, then its
    socket closed (its daemon ends with it) once the other side had time to finish."""
    with open(times, "w") as f:
        json.dump(stamps, f)
    print(json.dumps(await window), flush=True)
    await asyncio.sleep(0.5)
    reader.cancel()
    out.close()


async def gen_engine(args: argparse.Namespace) -> None:
    """--in-flight slots, each: recv, tell the context engine (the pipe), wait for done;
    writes each request's done time (monotonic ns) to --times."""
    r, w = await asyncio.open_unix_connection(args.sock)
    out = CorkedWriter(w)
    waiting: dict[str, asyncio.Future[None]] = {}
    done_ns: dict[str, int] = {}
    count = [0]

    async def read_loop() -> None:
        while (f := await CODEC.read(r)) is not None:
            done_ns[f.rid] = time.monotonic_ns()  # as the bench: when the outcome is read
            waiting.pop(f.rid).set_result(None)

    async def slot(k: int) -> None:
        i = 0
        while time.time() < args.end:
            rid = f"{k}-{i}"
            fut = asyncio.get_running_loop().create_future()
            waiting[rid] = fut
            out.write(CODEC.encode(Frame("recv", rid, block=k)))
            await out.drain()  # the recv is on its way before the send is asked for
            os.write(args.pipe, f"{rid}\n".encode())
            await fut
            count[0] += 1
            i += 1

    reader = asyncio.ensure_future(read_loop())
    window = asyncio.ensure_future(_window(args.start, args.end, count))
    await asyncio.gather(*(slot(k) for k in range(args.in_flight)))
    os.close(args.pipe)  # the context engine ends
    await _engine_end(args.times, done_ns, window, reader, out)


async def ctx_engine(args: argparse.Namespace) -> None:
    """Sends each request the generation engine names on the pipe, as soon as it does (the
    bench's order: generation first); writes each send's time (monotonic ns) to --times."""
    r, w = await asyncio.open_unix_connection(args.sock)
    out = CorkedWriter(w)
    loop = asyncio.get_running_loop()
    pipe = asyncio.StreamReader()
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(pipe), os.fdopen(args.pipe, "rb")
    )
    sent_ns: dict[str, int] = {}

    async def drain_outcomes() -> None:
        while await CODEC.read(r) is not None:
            pass

    outcomes = asyncio.ensure_future(drain_outcomes())
    window = asyncio.ensure_future(_window(args.start, args.end))
    while line := await pipe.readline():
        rid = line.decode().strip()
        sent_ns[rid] = time.monotonic_ns()
        out.write(CODEC.encode(Frame("send", rid, block=int(rid.split("-")[0]))))
    await _engine_end(args.times, sent_ns, window, outcomes, out)


def _json_line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    while line := proc.stdout.readline():
        if line.startswith("{"):
            return dict(json.loads(line))
    raise SystemExit(f"a skeleton process (pid {proc.pid}) ended without its report")


def skeleton(in_flight: int, seconds: float) -> dict[str, float]:
    tmp = tempfile.mkdtemp(prefix="kvxferd-skeleton.")
    start = time.time() + 8.0  # NIXL agents and dials first, then 1 s of warm-up
    end = start + seconds

    def spawn(role: str, *extra: str, fds: tuple[int, ...] = ()) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, __file__, "--role", role, "--start", str(start), "--end", str(end),
             "--in-flight", str(in_flight), *extra],
            stdout=subprocess.PIPE, text=True, pass_fds=fds,
        )  # fmt: skip

    ctx = spawn("ctx-daemon", "--sock", os.path.join(tmp, "ctx.sock"))
    port = _json_line(ctx)["port"]
    gen = spawn("gen-daemon", "--sock", os.path.join(tmp, "gen.sock"), "--port", str(port))
    _json_line(gen)
    read_end, write_end = os.pipe()
    times = [os.path.join(tmp, "sent.json"), os.path.join(tmp, "done.json")]
    engines = [
        spawn("ctx-engine", "--sock", os.path.join(tmp, "ctx.sock"), "--pipe", str(read_end),
              "--times", times[0], fds=(read_end,)),
        spawn("gen-engine", "--sock", os.path.join(tmp, "gen.sock"), "--pipe", str(write_end),
              "--times", times[1], fds=(write_end,)),
    ]  # fmt: skip
    os.close(read_end)
    os.close(write_end)
    if time.time() > start - 1.0:
        raise SystemExit("the skeleton took too long to start: no warm-up left")
    reports = [_json_line(p) for p in (*engines, ctx, gen)]
    for p in (*engines, ctx, gen):
        p.wait(timeout=60)
    done = reports[1]["count"]
    engines_ms = (reports[0]["cpu_s"] + reports[1]["cpu_s"]) / done * 1e3
    daemons_ms = (reports[2]["cpu_s"] + reports[3]["cpu_s"]) / done * 1e3
    with open(times[0]) as f:
        sent = json.load(f)
    with open(times[1]) as f:
        finished = json.load(f)
    latencies = [finished[rid] - t for rid, t in sent.items() if rid in finished]
    return {
        "requests_per_s": done / seconds,
        "cpu_ms_per_request": engines_ms + daemons_ms,
        "daemons_cpu_ms_per_request": daemons_ms,
        "p50_ms": statistics.median(latencies) / 1e6,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--in-flight", type=int, nargs="+", default=[1, 32])
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--sock", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--start", type=float, help=argparse.SUPPRESS)
    p.add_argument("--end", type=float, help=argparse.SUPPRESS)
    p.add_argument("--pipe", type=int, help=argparse.SUPPRESS)
    p.add_argument("--times", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        roles = {"ctx-daemon": ctx_daemon, "gen-daemon": gen_daemon, "ctx-engine": ctx_engine}
        role = roles.get(args.role, gen_engine)
        args.in_flight = args.in_flight[0]
        uvloop.run(role(args))
        return 0
    rows: dict[int, list[dict[str, float]]] = {n: [] for n in args.in_flight}
    for n in range(args.passes):
        for in_flight in args.in_flight:
            sk = skeleton(in_flight, args.seconds)
            b = bench(None, in_flight, args.seconds, None)
            bare = b["bare_requests_per_s"]
            cpu = b["cpu_ms_per_request"] + (b.get("engines_cpu_ms_per_request") or 0.0)
            row = {
                "pass": n + 1,
                "in_flight": in_flight,
                "bare": bare,
                "skeleton": sk["requests_per_s"],
                "kvxferd": b["requests_per_s"],
                "skeleton_vs_bare": sk["requests_per_s"] / bare,
                "kvxferd_vs_bare": b["requests_per_s"] / bare,
                "skeleton_cpu_ms": sk["cpu_ms_per_request"],
                "kvxferd_cpu_ms": cpu,
                "skeleton_daemons_cpu_ms": sk["daemons_cpu_ms_per_request"],
                "kvxferd_daemons_cpu_ms": b["cpu_ms_per_request"],
                # One slot's request after request: the chain's time per request.
                "bare_p50_ms": b["raw_p50_ms"],
                "skeleton_p50_ms": sk["p50_ms"],
                "kvxferd_p50_ms": b["p50_ms"],
                "load": os.getloadavg()[0],
            }
            rows[in_flight].append(row)
            print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
    keys = ["bare", "skeleton", "kvxferd", "skeleton_vs_bare", "kvxferd_vs_bare",
            "skeleton_cpu_ms", "kvxferd_cpu_ms", "skeleton_daemons_cpu_ms",
            "kvxferd_daemons_cpu_ms", "bare_p50_ms", "skeleton_p50_ms",
            "kvxferd_p50_ms"]  # fmt: skip
    print("| in flight | runs | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for in_flight, got in rows.items():
        cells = [cell(stat([r[k] for r in got])) for k in keys]
        print(f"| {in_flight} | {len(got)} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one framed message costs a Python process on this host (issue 16's small requests).

Two processes on uvloop exchange kvxferd's own frames (FrameCodec + CorkedWriter, a small
msgspec Struct like a Result) over TCP loopback (the peer channel) or a Unix socket (the
engine API): the first keeps --outstanding requests in flight, the second answers each.
Reported per transport and outstanding count: round trips per second and the CPU time
(user + system, both processes) per round trip, i.e. per message pair.

A `--small` request through the daemons is ~13 such frames (engine API: recv, send and two
releases with their replies and two outcomes; the peer channel: RequestData and Result;
the bench's own slot pipe), plus the engines' fill and verify. CPU per frame times 13 is
a floor for the daemon path's CPU per request that no change inside a daemon removes, and
two cores divided by it bound the request rate.

    .venv/bin/python benchmarks/issue16_small_bound.py --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time

import msgspec
import uvloop

from kvxferd.peers.framing import CorkedWriter, FrameCodec


class Msg(msgspec.Struct, tag="msg"):
    request_id: str
    status: str = "done"
    nbytes: int = 32768


CODEC: FrameCodec[Msg] = FrameCodec(Msg, "bound")


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    out = CorkedWriter(writer)
    while (msg := await CODEC.read(reader)) is not None:
        out.write(CODEC.encode(msg))
    out.close()


def _child(kind: str, where: str) -> None:
    async def main() -> None:
        if kind == "tcp":
            r, w = await asyncio.open_connection("127.0.0.1", int(where))
        else:
            r, w = await asyncio.open_unix_connection(where)
        await _answer(r, w)

    uvloop.run(main())


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(kind: str, outstanding: int, seconds: float) -> dict[str, object]:
    accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
        asyncio.get_running_loop().create_future()
    )

    def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.set_result((r, w))

    tmp = tempfile.mkdtemp()
    if kind == "tcp":
        server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        where = str(server.sockets[0].getsockname()[1])
    else:
        where = os.path.join(tmp, "s")
        server = await asyncio.start_unix_server(on_conn, where)
    child = subprocess.Popen([sys.executable, __file__, "--child", kind, where])
    pid = child.pid
    reader, writer = await asyncio.wait_for(accepted, 60)
    if kind == "tcp":
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = CorkedWriter(writer)
    done = 0
    waiting: dict[str, asyncio.Future[None]] = {}

    async def read_loop() -> None:
        while (msg := await CODEC.read(reader)) is not None:
            waiting.pop(msg.request_id).set_result(None)

    async def slot(k: int, stop: float) -> None:
        nonlocal done
        i = 0
        while time.monotonic() < stop:
            rid = f"{k}-{i}"
            fut = asyncio.get_running_loop().create_future()
            waiting[rid] = fut
            out.write(CODEC.encode(Msg(request_id=rid)))
            await fut
            done += 1
            i += 1

    rl = asyncio.create_task(read_loop())
    await asyncio.gather(*(slot(k, time.monotonic() + 0.3) for k in range(outstanding)))  # warm
    done = 0
    me = resource.getrusage(resource.RUSAGE_SELF)
    child0 = _cpu(pid)
    t0 = time.monotonic()
    await asyncio.gather(*(slot(k, t0 + seconds) for k in range(outstanding)))
    wall = time.monotonic() - t0
    me1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (me1.ru_utime - me.ru_utime) + (me1.ru_stime - me.ru_stime) + _cpu(pid) - child0
    out.close()
    rl.cancel()
    await asyncio.to_thread(child.wait, 30)  # ends when it reads our end of stream
    server.close()
    return {
        "transport": kind,
        "outstanding": outstanding,
        "round_trips_per_s": round(done / wall),
        "cpu_us_per_round_trip": round(cpu / done * 1e6, 1),
        "cpu_cores_busy": round(cpu / wall, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--outstanding", default="1,32")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(*args.child)
        return 0
    results = []
    for kind in ("tcp", "unix"):
        for n in map(int, args.outstanding.split(",")):
            r = uvloop.run(_drive(kind, n, args.seconds))
            results.append(r)
            print(json.dumps(r), flush=True)
    print(json.dumps({"loadavg": os.getloadavg(), "cpu_count": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

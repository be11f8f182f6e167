"""Bare transport pairs: a staged request's bytes moved by the transport alone, no daemon.

The staged runtime (transceiver_runtime CPP) gathers a request's blocks into a contiguous
staging reservation and moves it to the receiver's reservation in *rounds*; this module moves
the same rounds between two contiguous buffers with the transport and nothing else, so a
staged configuration can be reported against its own transport (`ratio_to_bare`).

Two processes per pair, started by the bench driver (kvxferd.bench.bare_run), for one of the
transports of kvxferd/bench/bare_nixl.py, bare_ucx.py, bare_mpi.py, bare_mooncake.py:

* `python -m kvxferd.bench.bare_X receiver --plan FILE --info-out FILE [--staging-tokens N]`
  maps its round buffer, opens the transport, listens on a Unix control socket, writes what
  the sender needs to --info-out, and serves rounds until the sender hangs up.
* `python -m kvxferd.bench.bare_X sender --plan FILE --receiver-info FILE ...` runs the
  plan's request sequence (same warm-up and timed counts, same lengths) and prints one JSON
  object (its records) on stdout.

What one round is: `staged_rounds` cuts a request of n blocks exactly as the daemons do
(kvxferd.transceiver.staging: the staging region holds max_tokens_in_buffer, else the
engine's max_seq_len, else 8192 tokens of whole blocks; a one-sided transport's receiver
offers at most half of it, a two-sided one's the whole region). Both buffers are the
daemon's own kind of staging memory (BounceRegion: private anonymous pages, populated), as
large as the largest round, and every round goes from offset 0 to offset 0, as a request's
reservation is reused round after round.

Per round, over the control socket (JSON lines, none of it timed): the sender fills its
buffer with the round's content (kvxferd.sim.content, a seed per round), says `round`; the
receiver zeroes its buffer, posts its receive (two-sided) and says `ready`. The sender then
takes t_start and moves the round with the daemon's own adapter (one contiguous segment, or
one tagged message). Done is, one-sided, the adapter reporting DONE to the sender (polled
as the daemons poll: 0.1 ms, doubling to 2 ms); two-sided, the receiver's receive returning
(t_done taken there: one monotonic clock for the machine), which it reports. The sender
then asks `verify`, and the receiver checks every byte. A request's latency is the sum of
its rounds' (t_start, t_done): the transport's time, without the gather, the scatter and
the round acknowledgements that the staged runtime adds between rounds.

CPU: both processes' utime + stime (kvxferd.bench.cpu) is read by the sender right before
each round's t_start and right after its done, so filling and verifying are not counted;
`cpu` in the report holds the sum per group.

Sweep mode with one request in flight only: the staged runtime's concurrency across
requests has no bare equivalent here, and the driver measures no bare pair otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from kvxferd.bench import cpu
from kvxferd.bench.plan import SWEEP, Geometry, Plan
from kvxferd.service.heap_tuning import keep_freed_heap
from kvxferd.service.runner import run_event_loop
from kvxferd.sim.content import fill_blocks, request_seed, verify_blocks
from kvxferd.transceiver.bounce import BounceRegion
from kvxferd.transceiver.staging import DEFAULT_STAGING_TOKENS, blocks_per_round, staging_bytes

#: Test hook: when set to "1" in the sender's environment, its first timed round is filled
#: with another round's content, so the receiver must report a mismatch.
CORRUPT_ENV = "KVXFERD_BENCH_BARE_TEST_CORRUPT"
#: How long the sender waits for any one control answer (a round of 1 GB over a slow
#: transport takes seconds; a silent receiver should still end the run).
_ANSWER_S = 300.0


class BareError(RuntimeError):
    """A bare pair could not run a round (reported by the sender, failing the run)."""


def staged_rounds(
    geometry: Geometry, blocks: int, one_sided: bool, staging_tokens: int = DEFAULT_STAGING_TOKENS
) -> list[int]:
    """Blocks per round of a request of `blocks` blocks, as the staged runtime cuts it
    (kvxferd.transceiver.staged_rx.StagedReceive.make_offer and StagedMover.write_slice)."""
    block_bytes = geometry.block_bytes
    region = staging_bytes(staging_tokens, geometry.tokens_per_block, block_bytes)
    k = blocks_per_round(region, blocks, [block_bytes])
    if one_sided:  # a stalled one-sided peer may hold at most half the receive region
        half = blocks_per_round(region // 2, blocks, [block_bytes])
        if half > 0:
            k = min(k, half)
    if k < 1:
        raise BareError(
            f"the staging region ({region} bytes) cannot hold one block of {block_bytes} bytes"
        )
    full, rest = divmod(blocks, k)
    return [k] * full + ([rest] if rest else [])


def max_round_blocks(plan: Plan, one_sided: bool, staging_tokens: int) -> int:
    return max(
        max(staged_rounds(plan.geometry, plan.geometry.blocks_for(t), one_sided, staging_tokens))
        for t in plan.lengths
    )


class Link(Protocol):
    """One side of a bare transport pair (kvxferd.bench.bare_links)."""

    one_sided: bool

    async def listen(self, region: BounceRegion) -> dict[str, Any]:
        """Receiver: open the transport onto `region`; what the sender needs to reach it."""
        ...

    def accept(self, hello: dict[str, Any]) -> None:
        """Receiver: the sender's hello (what `attach` returned)."""
        ...

    async def settle(self, timeout_s: float) -> None:
        """Receiver: wait until the sender's connection is usable."""
        ...

    async def attach(self, region: BounceRegion, info: dict[str, Any]) -> dict[str, Any]:
        """Sender: open the transport from `region` to the receiver `info`; its hello."""
        ...

    async def receive(self, tag: int, out: memoryview) -> None:
        """Receiver: take the round `tag` into `out` (one-sided: nothing to do)."""
        ...

    async def send(self, tag: int, nbytes: int) -> None:
        """Sender: move `nbytes` from the start of its region to the start of the
        receiver's; returns when done (module docstring)."""
        ...

    async def close(self) -> None: ...


@dataclass
class RoundRecord:
    request_id: str
    tokens: int
    timed: bool
    round: int
    blocks: int
    nbytes: int
    t_start_ns: int = 0
    t_done_ns: int = 0


def _round_layout(geometry: Geometry, blocks: int) -> Any:
    return geometry.kv_layout(blocks)


# -- receiver ------------------------------------------------------------------------------------


async def _send_line(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    writer.write((json.dumps(msg) + "\n").encode())
    await writer.drain()


async def _read_line(reader: asyncio.StreamReader, what: str) -> dict[str, Any]:
    line = await asyncio.wait_for(reader.readline(), _ANSWER_S)
    if not line:
        raise BareError(f"the other side of the bare pair hung up while {what}")
    msg: dict[str, Any] = json.loads(line)
    return msg


class _Receiver:
    def __init__(self, link: Link, plan: Plan, region: BounceRegion) -> None:
        self.link = link
        self.plan = plan
        self.region = region
        self.finished = asyncio.Event()
        self.error = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.link.accept(await _read_line(reader, "saying hello"))
            await self.link.settle(60.0)
            await _send_line(writer, {"op": "welcome"})
            while True:
                line = await reader.readline()
                if not line:
                    return
                msg = json.loads(line)
                if msg["op"] == "end":
                    return
                await self._round(msg, reader, writer)
        except Exception as exc:  # said to the sender, which fails the run with it
            self.error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                await _send_line(writer, {"op": "error", "error": self.error})
        finally:
            writer.close()
            self.finished.set()

    async def _round(
        self, msg: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        nbytes, blocks = int(msg["nbytes"]), int(msg["blocks"])
        self.region.array[:nbytes] = 0  # so that a round that did not land cannot verify
        out = self.region.array[:nbytes].data
        receiving = asyncio.ensure_future(self.link.receive(int(msg["tag"]), out))
        await asyncio.sleep(0)  # the receive is posted (or probing) before the sender starts
        await _send_line(writer, {"op": "ready"})
        await receiving
        if not self.link.one_sided:
            await _send_line(writer, {"op": "received", "t_done_ns": time.monotonic_ns()})
        ask = await _read_line(reader, "asking to verify")
        if ask["op"] != "verify":
            raise BareError(f"expected verify, got {ask['op']!r}")
        layout = _round_layout(self.plan.geometry, blocks)
        result = verify_blocks(
            self.region.array[: layout.pool_bytes],
            layout,
            list(range(blocks)),
            int(msg["seed"]),
            blocks * layout.tokens_per_block,
        )
        await _send_line(
            writer, {"op": "verified", "ok": result.ok, "error": result.first_mismatch or ""}
        )


async def receiver(link: Link, args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    blocks = max_round_blocks(plan, link.one_sided, args.staging_tokens)
    region = BounceRegion(plan.geometry.block_bytes * blocks, "recv")
    control = args.info_out + ".sock"
    try:
        info = await link.listen(region)
        side = _Receiver(link, plan, region)
        server = await asyncio.start_unix_server(side.serve, control)
        info |= {"control": control, "pid": os.getpid()}
        tmp = Path(args.info_out + ".tmp")
        tmp.write_text(json.dumps(info))
        tmp.rename(args.info_out)  # whole, so the driver never reads half of it
        async with server:
            await side.finished.wait()
        if side.error:
            print(f"bare receiver: {side.error}", file=sys.stderr)
        return 1 if side.error else 0
    finally:
        with contextlib.suppress(Exception):
            await link.close()
        with contextlib.suppress(OSError):
            os.unlink(control)
        region.close()


# -- sender --------------------------------------------------------------------------------------


class _Sender:
    def __init__(
        self,
        link: Link,
        plan: Plan,
        args: argparse.Namespace,
        info: dict[str, Any],
        region: BounceRegion,
    ) -> None:
        self.link = link
        self.plan = plan
        self.region = region
        self.staging_tokens = int(args.staging_tokens)
        self.progress_fd = args.progress_fd
        self.pids = [os.getpid(), int(info["pid"])]
        self.records: list[RoundRecord] = []
        self.cpu: list[dict[str, Any]] = []
        self.verified = 0
        self.timed_start_ns = 0
        self.tag = 0
        self.corrupt = os.environ.get(CORRUPT_ENV) == "1"

    def _tick(self) -> None:
        if self.progress_fd is not None:
            with contextlib.suppress(BlockingIOError):
                os.write(self.progress_fd, b".")

    async def run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.plan.mode != SWEEP or self.plan.in_flight != 1:
            raise BareError("a bare pair runs sweeps with one request in flight only")
        for group in self.plan.groups():
            _, self.timed_start_ns = self.plan.start_group(group, self.timed_start_ns)
            spent = 0.0
            for item in group.slot_items(0, 1):
                rounds = staged_rounds(
                    self.plan.geometry, item.blocks, self.link.one_sided, self.staging_tokens
                )
                for index, blocks in enumerate(rounds):
                    rec = RoundRecord(
                        item.request_id, item.tokens, item.timed, index, blocks,
                        blocks * self.plan.geometry.block_bytes,
                    )  # fmt: skip
                    spent += await self._round(rec, reader, writer)
                    self.records.append(rec)
                self._tick()
            self.cpu.append({"group": group.key, "tokens": group.tokens,
                             "timed": group.timed, "cpu_s": spent})  # fmt: skip
        await _send_line(writer, {"op": "end"})

    async def _round(
        self, rec: RoundRecord, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> float:
        """Move one round; the CPU seconds both processes spent moving it."""
        layout = _round_layout(self.plan.geometry, rec.blocks)
        seed = request_seed(f"{rec.request_id}/round{rec.round}")
        filled = seed
        if rec.timed and self.corrupt:
            filled, self.corrupt = request_seed("another round"), False
        fill_blocks(self.region.array[: layout.pool_bytes], layout, list(range(rec.blocks)), filled)
        self.tag += 1
        await _send_line(
            writer,
            {"op": "round", "tag": self.tag, "nbytes": rec.nbytes, "blocks": rec.blocks,
             "seed": seed},
        )  # fmt: skip
        self._expect(await _read_line(reader, "getting ready for a round"), "ready")
        before = cpu.sample(self.pids)
        rec.t_start_ns = time.monotonic_ns()
        await self.link.send(self.tag, rec.nbytes)
        if self.link.one_sided:
            rec.t_done_ns = time.monotonic_ns()
        else:
            got = self._expect(await _read_line(reader, "receiving a round"), "received")
            rec.t_done_ns = int(got["t_done_ns"])
        spent = cpu.spent(before, cpu.sample(self.pids)) or 0.0
        await _send_line(writer, {"op": "verify"})
        answer = self._expect(await _read_line(reader, "verifying a round"), "verified")
        if not answer["ok"]:
            raise BareError(
                f"request {rec.request_id}, round {rec.round}: verification failed: "
                f"{answer['error']}"
            )
        self.verified += 1
        return spent

    @staticmethod
    def _expect(msg: dict[str, Any], op: str) -> dict[str, Any]:
        if msg.get("op") == "error":
            raise BareError(f"the bare receiver failed: {msg.get('error')}")
        if msg.get("op") != op:
            raise BareError(f"the bare receiver answered {msg.get('op')!r}, {op!r} expected")
        return msg


async def sender(link: Link, args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    info = json.loads(Path(args.receiver_info).read_text())
    if args.progress_fd is not None:
        os.set_blocking(args.progress_fd, False)
    report: dict[str, Any] = {"error": "", "transport": args.transport}
    blocks = max_round_blocks(plan, link.one_sided, args.staging_tokens)
    region = BounceRegion(plan.geometry.block_bytes * blocks, "send")
    side = _Sender(link, plan, args, info, region)
    try:
        hello = await link.attach(region, info)
        reader, writer = await asyncio.open_unix_connection(info["control"])
        try:
            await _send_line(writer, hello)
            side._expect(await _read_line(reader, "welcoming the sender"), "welcome")
            await side.run(reader, writer)
        finally:
            writer.close()
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
    finally:
        with contextlib.suppress(Exception):
            await link.close()
        region.close()
    report["records"] = [asdict(r) for r in side.records]
    report["verified"] = side.verified
    report["cpu"] = side.cpu
    report["timed_start_ns"] = side.timed_start_ns
    json.dump(report, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")
    return 0


def main(make_link: Callable[[], Link], transport: str, argv: list[str] | None = None) -> int:
    """The command line of a bare_X module: `receiver` or `sender` over `make_link()`."""
    p = argparse.ArgumentParser(prog=f"python -m kvxferd.bench.bare_{transport.lower()}")
    sub = p.add_subparsers(dest="role", required=True)
    for role in ("receiver", "sender"):
        r = sub.add_parser(role)
        r.add_argument("--plan", required=True)
        r.add_argument(
            "--staging-tokens",
            type=int,
            default=DEFAULT_STAGING_TOKENS,
            help="tokens the daemons' staging regions hold (their round size follows)",
        )
        if role == "receiver":
            r.add_argument("--info-out", required=True)
        else:
            r.add_argument("--receiver-info", required=True)
            r.add_argument("--progress-fd", type=int, default=None)
    args = p.parse_args(argv)
    args.transport = transport
    keep_freed_heap()  # the daemons' allocator, so that only the transport is compared
    link = make_link()
    side = receiver if args.role == "receiver" else sender

    async def run() -> int:
        return await side(link, args)

    return run_event_loop(run)

"""`kvxferd bench --pipeline-compare`: transfer time left exposed after the last prefill chunk.

The context engine "computes" each request in prefill chunks of `--chunk-tokens` tokens: per
chunk it sleeps `--compute-ms` (a GPU's prefill leaves the host's cores free, so the engine
sleeps rather than spins), writes that chunk's KV into its blocks (fresh in memory, as a
prefill writes it) and sends the chunk: send(request, blocks so far, token_end,
token_start=..., last=...). The generation engine posts one receive for the whole request.

The same requests run through two daemon pairs, one after the other, with the same engine
behaviour and engine settings (chunked prefill on):

* pipelined (`nixl-python-pipelined`, enable_pipelined_transfer: true): the daemon writes each
  chunk's complete blocks while later chunks compute;
* sequential (`nixl-python`, pipelining off): the daemon writes the whole request after the
  last chunk.

Per request, exposed time = t_done (the outcome reached the generation engine) minus the
moment just before the last chunk's send. One chunk's transfer time is measured in the same
runs by requests of exactly `--chunk-tokens` tokens (one chunk: their exposed time is their
whole transfer). Lengths of --tokens not longer than one chunk are left out: nothing to
pipeline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from kvxferd.bench.configs import BenchConfig, resolve
from kvxferd.bench.engine import ContextSide
from kvxferd.bench.plan import SWEEP, Item
from kvxferd.bench.stats import percentile
from kvxferd.sim.content import fill_blocks
from kvxferd.transceiver.state import Outcome

if TYPE_CHECKING:
    from kvxferd.bench.report import Format

PIPELINED = "nixl-python-pipelined"
SEQUENTIAL = "nixl-python"
MODE = "pipeline"


class ComputingContextSide(ContextSide):
    """The context engine of --pipeline-compare: chunk by chunk, compute (sleep), write the
    chunk's KV, send the chunk. Stamps t_last_send_ns just before the last chunk's send."""

    chunk_tokens = 0
    compute_s = 0.0

    def compute(self, chunk_tokens: int, compute_s: float) -> None:
        self.chunk_tokens = chunk_tokens
        self.compute_s = compute_s
        self._seeds: dict[int, int] = {}

    def _fill(self, blocks: list[int], seed: int) -> None:
        # Not yet: each chunk's KV is written when its prefill completes (in _send). Keyed by
        # the first block: requests in flight never share blocks.
        self._seeds[blocks[0]] = seed

    async def _send(self, item: Item, blocks: list[int]) -> Outcome:
        rec = next(r for r in reversed(self.records) if r.request_id == item.request_id)
        seed = self._seeds.pop(blocks[0])
        tpb = self.layout.tokens_per_block
        filled = 0
        for start in range(0, item.tokens, self.chunk_tokens):
            end = min(item.tokens, start + self.chunk_tokens)
            await asyncio.sleep(self.compute_s)  # the chunk's prefill
            upto = -(-end // tpb)
            fill_blocks(self.region.array, self.layout, blocks[filled:upto], seed, start=filled)
            filled = upto
            last = end == item.tokens
            if last:
                rec.t_last_send_ns = time.monotonic_ns()
            await self.client.send(
                item.request_id, self.pool_id, blocks[:upto], end, token_start=start, last=last
            )
        return await self.client.wait(item.request_id, self.wait_s)


@dataclass(frozen=True)
class PipelineOptions:
    chunk_tokens: int = 512
    compute_ms: float = 50.0


def lengths_for(lengths: list[int], chunk_tokens: int) -> list[int]:
    """The plan's lengths: one chunk first, then the requested lengths longer than a chunk."""
    return [chunk_tokens, *(t for t in lengths if t > chunk_tokens)]


def configs() -> tuple[BenchConfig, BenchConfig]:
    """(pipelined, sequential): both with the pipelined configuration's engine settings, and
    no chunking of their own (the computing engine chunks by --chunk-tokens)."""
    pipelined, sequential = resolve([PIPELINED, SEQUENTIAL])
    return (
        dataclasses.replace(pipelined, chunk_blocks=0),
        dataclasses.replace(
            sequential, engine={**sequential.engine, **pipelined.engine}, chunk_blocks=0
        ),
    )


def _exposed(
    gen: dict[str, Any], ctx: dict[str, Any], tokens: int, nbytes: int, name: str
) -> tuple[list[float], list[float]]:
    """(exposed ms, first-send-to-done ms) per timed request of `tokens`, every one checked."""
    # Imported here: the bench engine imports this module in every context run, and
    # phases brings the daemon-side modules it never needs.
    from kvxferd.bench.phases import daemon_intervals

    daemon_intervals(gen, ctx, tokens, nbytes, name)  # raises unless all verified and sent
    sends = {r["request_id"]: r for r in ctx.get("records", [])}
    exposed, total = [], []
    for r in gen.get("records", []):
        if r["timed"] and r["tokens"] == tokens:
            s = sends[r["request_id"]]
            exposed.append((int(r["t_done_ns"]) - int(s["t_last_send_ns"])) / 1e6)
            total.append((int(r["t_done_ns"]) - int(s["t_send_ns"])) / 1e6)
    return exposed, total


def _sig(x: float) -> float:
    return float(f"{x:.5g}")


def run(
    opts: Any, popts: PipelineOptions, *, progress: bool = True, stream: TextIO | None = None
) -> dict[str, Any]:
    """Run --pipeline-compare (opts: runner.Options) and return its report."""
    from kvxferd.bench import runner
    from kvxferd.bench.phases import daemon_run

    pipelined, sequential = configs()
    g = opts.geometry
    lengths = lengths_for(opts.lengths, popts.chunk_tokens)
    plan = runner.build_plan(opts, "p", lengths, SWEEP)
    units = len(lengths) * (plan.warmup + plan.requests)
    ctx_args = ["--chunk-tokens", str(popts.chunk_tokens), "--compute-ms", str(popts.compute_ms)]
    with runner.workspace(opts, plan, 2 * units, progress, stream) as (plan_path, workdir, prog):
        report = runner._header(opts, plan)
        report.update(
            mode=MODE,
            configs=[pipelined.name, sequential.name],
            chunk_tokens=popts.chunk_tokens,
            compute_ms=popts.compute_ms,
        )
        measured: dict[str, dict[int, tuple[list[float], list[float]]]] = {}
        for label, config in (("pipelined", pipelined), ("sequential", sequential)):
            prog.start_phase(f"{config.name} ({label})", units)
            gen, ctx = daemon_run(config, plan_path, plan, workdir, prog, opts.timeout_s, ctx_args)
            gen.pop("daemon_status", None)
            measured[label] = {
                t: _exposed(gen, ctx, t, g.request_bytes(t), config.name) for t in lengths
            }
            last = measured[label][lengths[-1]][0]
            prog.end_phase(f"{lengths[-1]} tok: {percentile(last, 50):.1f} ms exposed")
        report["results"] = _results(report, measured, lengths, popts)
        report["host"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if opts.keep:
        report["workdir"] = str(workdir)
    return report


def _results(
    report: dict[str, Any],
    measured: dict[str, dict[int, tuple[list[float], list[float]]]],
    lengths: list[int],
    popts: PipelineOptions,
) -> list[dict[str, Any]]:
    def p(values: list[float], q: float) -> float:
        return _sig(percentile(values, q))

    g_bytes = report["geometry"]["block_bytes"]
    tpb = report["geometry"]["tokens_per_block"]
    chunk = measured["sequential"][popts.chunk_tokens][0]
    chunk_pipelined = measured["pipelined"][popts.chunk_tokens][0]
    results = []
    for t in lengths[1:]:
        pipe_exp, pipe_total = measured["pipelined"][t]
        seq_exp, seq_total = measured["sequential"][t]
        chunks = math.ceil(t / popts.chunk_tokens)
        blocks = math.ceil(t / tpb)
        results.append(
            {
                "tokens": t,
                "blocks": blocks,
                "bytes": blocks * g_bytes,
                "chunks": chunks,
                "last_chunk_tokens": t - (chunks - 1) * popts.chunk_tokens,
                "requests": len(pipe_exp),
                "verified": len(pipe_exp) + len(seq_exp),
                "pipelined_exposed_ms": p(pipe_exp, 50),
                "pipelined_exposed_p99_ms": p(pipe_exp, 99),
                "sequential_exposed_ms": p(seq_exp, 50),
                "sequential_exposed_p99_ms": p(seq_exp, 99),
                "chunk_transfer_ms": p(chunk, 50),
                "chunk_transfer_p99_ms": p(chunk, 99),
                "pipelined_chunk_transfer_ms": p(chunk_pipelined, 50),
                "pipelined_total_ms": p(pipe_total, 50),
                "sequential_total_ms": p(seq_total, 50),
                "compute_total_ms": _sig(chunks * popts.compute_ms),
                "exposed_vs_chunk": _sig(
                    percentile(pipe_exp, 50) / percentile(chunk, 50) if chunk else 0.0
                ),
                "sequential_vs_chunk": _sig(
                    percentile(seq_exp, 50) / percentile(chunk, 50) if chunk else 0.0
                ),
            }
        )
    if results:
        # The top-level values are those of the longest request.
        for key in ("pipelined_exposed_ms", "pipelined_exposed_p99_ms", "sequential_exposed_ms",
                    "sequential_exposed_p99_ms", "chunk_transfer_ms", "chunk_transfer_p99_ms",
                    "exposed_vs_chunk", "tokens"):  # fmt: skip
            report[key if key != "tokens" else "summary_tokens"] = results[-1][key]
    return results


_COLUMNS = {
    "tokens": "tokens",
    "chunks": "chunks",
    "bytes": "MiB/req",
    "pipelined_exposed_ms": "pipelined p50",
    "pipelined_exposed_p99_ms": "p99",
    "sequential_exposed_ms": "sequential p50",
    "sequential_exposed_p99_ms": "p99",
    "chunk_transfer_ms": "1 chunk p50",
    "chunk_transfer_p99_ms": "p99",
    "exposed_vs_chunk": "pipe/chunk",
    "sequential_vs_chunk": "seq/chunk",
}
# Counts as they are, MiB in tenths, times (ms) and ratios in hundredths.
_FORMATS: dict[str, Format] = {
    "tokens": "",
    "chunks": "",
    "bytes": lambda nbytes: f"{nbytes / 2**20:.1f}",
}


def format_table(report: dict[str, Any]) -> str:
    from kvxferd.bench.report import column_table, header_lines

    lines = header_lines(report)
    lines.append(
        f"  chunks    {report['chunk_tokens']} tokens each, {report['compute_ms']:g} ms of "
        "compute per chunk (the context engine sleeps), then the chunk is sent"
    )
    lines.append("")
    lines += column_table(_COLUMNS, report["results"], ".2f", _FORMATS)
    lines.append(
        "\nexposed: t_done at the generation engine - the moment the last chunk was sent (ms); "
        "1 chunk: a request of one chunk, its whole transfer (sequential daemon); "
        "pipe/chunk, seq/chunk: p50 exposed / p50 one chunk"
    )
    return "\n".join(lines)

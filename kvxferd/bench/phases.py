"""One measurement's processes, and what their records say: the raw NIXL pair (raw_run) and
one configuration through two daemons with two bench engines (daemon_run), each started,
relayed and joined here; then the timed intervals of their records (raw_intervals;
daemon_intervals, which also checks every request verified, sent and of the expected size)
and the raw pair's descriptor count (descriptors).

The runner (kvxferd.bench.runner) and the pipelined comparison (kvxferd.bench.pipeline)
both run their measurements through these.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvxferd.bench.bare_run import cpu_pids_args
from kvxferd.bench.children import BenchError, run_reporting
from kvxferd.bench.children import check_report as _check_report
from kvxferd.bench.children import spawn as _spawn
from kvxferd.bench.children import wait_all as _wait
from kvxferd.bench.configs import BenchConfig
from kvxferd.bench.fragmented import bounce_counters, daemon_status
from kvxferd.bench.plan import Plan
from kvxferd.bench.progress import Progress

# -- runs ----------------------------------------------------------------------------------------


def _memory_args(memory: str, vram_share: str | None = None) -> list[str]:
    """The child processes' memory options: none for host pools (their command lines are
    what they always were)."""
    if memory == "host":
        return []
    return ["--memory", memory] + ([] if vram_share is None else ["--vram-share", vram_share])


def raw_run(
    plan_path: Path,
    plan: Plan,
    workdir: Path,
    prog: Progress,
    timeout_s: float,
    memory: str = "host",
) -> dict[str, Any]:
    info = workdir / "raw-target.json"
    target = _spawn(
        workdir,
        "raw-target",
        ["-m", "kvxferd.bench.raw", "target", "--plan", str(plan_path), "--info-out", str(info),
         *_memory_args(memory)],
        stdin=subprocess.PIPE,
    )  # fmt: skip
    try:
        target.wait_for_file(info, "the raw NIXL target")
        init = run_reporting(
            workdir,
            "raw-initiator",
            ["-m", "kvxferd.bench.raw", "initiator", "--plan", str(plan_path),
             "--target-info", str(info), *_memory_args(memory)],
            prog,
            timeout_s,
            partners=[target],
        )  # fmt: skip
        report = init.report()
        _check_report("raw NIXL", report, "\n" + init.stderr_tail())
        return report
    finally:
        if target.proc.stdin is not None:
            with contextlib.suppress(OSError):
                target.proc.stdin.close()
        target.reap()


def daemon_run(
    config: BenchConfig,
    plan_path: Path,
    plan: Plan,
    workdir: Path,
    prog: Progress,
    timeout_s: float,
    ctx_args: Sequence[str] = (),
    memory: str = "host",
    vram_share: str = "ipc",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One configuration's run: (generation report, context report). `ctx_args`: extra
    options of the context engine. The generation report also holds `daemon_status`, each
    daemon's bounce counters read from /v1/status once the engines finished. `memory`
    vram: the daemons run with engine.kv_memory vram and the engines' pools are on the GPU."""
    from kvxferd.sim.cluster import LocalCluster

    cdir = workdir / config.name
    with LocalCluster(
        cdir,
        geometry=plan.geometry.cluster_geometry(),
        transceiver=dict(config.transceiver),
        tls=config.tls,
        kv_memory=memory,
        vram_share=vram_share,
    ) as cluster:
        ctx = cluster.start_daemon("bench-ctx", "context", engine=dict(config.engine))
        gen = cluster.start_daemon("bench-gen", "generation", engine=dict(config.engine))

        def logs() -> str:
            return "".join(
                f"\n--- {d.name} log ({d.log_path}) ---\n{d.log_text()[-2000:]}" for d in (ctx, gen)
            )

        notify_r, notify_w = os.pipe()
        prog_r, prog_w = os.pipe()
        common = ["-m", "kvxferd.bench.engine", "--plan", str(plan_path),
                  *_memory_args(memory, vram_share)]  # fmt: skip
        try:
            ctx_engine = _spawn(
                cdir,
                "engine-ctx",
                [*common, "--role", "context", "--socket", ctx.api_socket,
                 "--notify-fd", str(notify_r), "--chunk-blocks", str(config.chunk_blocks),
                 *ctx_args],
                pass_fds=(notify_r,),
            )  # fmt: skip
            gen_engine = _spawn(
                cdir,
                "engine-gen",
                [*common, "--role", "generation", "--socket", gen.api_socket,
                 "--peer", ctx.peer_address, "--notify-fd", str(notify_w),
                 "--progress-fd", str(prog_w), *cpu_pids_args(ctx.proc.pid, gen.proc.pid),
                 "--engine-pids", str(ctx_engine.proc.pid)],
                pass_fds=(notify_w, prog_w),
            )  # fmt: skip
        finally:
            for fd in (notify_r, notify_w, prog_w):
                os.close(fd)
        try:
            try:
                _wait([ctx_engine, gen_engine], prog_r, prog, timeout_s)
            except BenchError as exc:
                raise BenchError(f"{config.name}: {exc}{logs()}") from None
        finally:
            os.close(prog_r)
        # The generation engine's report first: it says why a request failed.
        gen_report = gen_engine.report()
        _check_report(f"{config.name}, generation engine", gen_report, logs())
        ctx_report = ctx_engine.report()
        _check_report(f"{config.name}, context engine", ctx_report, logs())
        gen_report["daemon_status"] = {
            "context": bounce_counters(daemon_status(ctx.http_address)),
            "generation": bounce_counters(daemon_status(gen.http_address)),
        }
        codes = cluster.stop_all()
        bad = {name: code for name, code in codes.items() if code != 0}
        if bad:
            raise BenchError(f"{config.name}: daemons exited with {bad}{logs()}")
    return gen_report, ctx_report


# -- joining records -----------------------------------------------------------------------------


def daemon_intervals(
    gen: dict[str, Any], ctx: dict[str, Any], tokens: int | None, expect_bytes: int, name: str
) -> list[tuple[int, int]]:
    sends = {r["request_id"]: r for r in ctx.get("records", [])}
    out = []
    for r in gen.get("records", []):
        if not r["timed"] or (tokens is not None and r["tokens"] != tokens):
            continue
        rid = r["request_id"]
        if r["status"] != "done" or not r["verified"]:
            raise BenchError(f"{name}: request {rid} not verified: {r['status']} {r['reason']}")
        if r["nbytes"] != expect_bytes:
            raise BenchError(
                f"{name}: request {rid}: the daemon reported {r['nbytes']} bytes, "
                f"{expect_bytes} expected"
            )
        send = sends.get(rid)
        if send is None or send["status"] != "done":
            raise BenchError(f"{name}: request {rid} has no successful send on the context side")
        out.append((int(send["t_send_ns"]), int(r["t_done_ns"])))
    return out


def raw_intervals(raw: dict[str, Any], tokens: int | None) -> list[tuple[int, int]]:
    return [
        (int(r["t_start_ns"]), int(r["t_done_ns"]))
        for r in raw.get("records", [])
        if r["timed"] and (tokens is None or r["tokens"] == tokens)
    ]


def descriptors(raw: dict[str, Any], tokens: int) -> int:
    counts = [r["descriptors"] for r in raw.get("records", []) if r["tokens"] == tokens]
    return max(counts) if counts else 0

"""Runs a benchmark: memcpy, the raw NIXL pair, then each configuration through real daemons.

Every measurement runs in processes of its own: two `kvxferd run` daemons started by
LocalCluster plus two bench engines (kvxferd.bench.engine) per configuration, and a raw NIXL
target and initiator (kvxferd.bench.raw), each started, relayed and joined by
kvxferd.bench.phases. This module sequences them for the two modes (the sweep and
--small) and builds the report from their records; it never touches the data path.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from kvxferd import __version__
from kvxferd.bench import bare_run, cpu
from kvxferd.bench.baseline import device_copy_gbps, memcpy_gbps
from kvxferd.bench.children import BenchError as BenchError  # re-exported: its old home
from kvxferd.bench.configs import BenchConfig
from kvxferd.bench.fragmented import annotate
from kvxferd.bench.host import check_memory, host_info
from kvxferd.bench.phases import daemon_intervals, daemon_run, descriptors, raw_intervals, raw_run
from kvxferd.bench.plan import SMALL, SWEEP, VERIFY_EACH, Geometry, Plan
from kvxferd.bench.progress import Progress
from kvxferd.bench.stats import Timing, ratio

#: About how long the processes of a phase take to start (for the --small progress bar).
_STARTUP_S = 3.0


@dataclass(frozen=True)
class Options:
    geometry: Geometry
    lengths: list[int]
    requests: int
    warmup: int
    in_flight: int
    configs: list[BenchConfig]
    small: bool = False
    seconds: float = 10.0
    shuffle: bool = True
    seed: int = 1
    timeout_s: float = 900.0
    keep: bool = False
    command: str = ""
    # Where both engines' pools (and the raw pair's) live: "host" or "vram" (GPU memory,
    # shared with the daemons by `vram_share`).
    memory: str = "host"
    vram_share: str = "ipc"
    # The engines' content discipline (kvxferd.bench.plan VERIFY_*).
    verify: str = VERIFY_EACH

    @property
    def mode(self) -> str:
        return SMALL if self.small else SWEEP


# -- the benchmark ---------------------------------------------------------------------------------


def _workdir() -> Path:
    from kvxferd.sim.cluster import default_workdir

    return default_workdir("kvxferd-bench")


def build_plan(
    opts: Options, run_id: str, lengths: list[int] | None = None, mode: str | None = None
) -> Plan:
    """The plan every process of one run shares, from the command's options."""
    return Plan.build(
        mode=opts.mode if mode is None else mode,
        geometry=opts.geometry,
        lengths=opts.lengths if lengths is None else lengths,
        requests=opts.requests,
        warmup=opts.warmup,
        in_flight=opts.in_flight,
        seconds=opts.seconds,
        run_id=run_id,
        seed=opts.seed,
        shuffle=opts.shuffle,
        verify=opts.verify,
    )


@contextlib.contextmanager
def workspace(
    opts: Options, plan: Plan, total: int, progress: bool, stream: TextIO | None
) -> Iterator[tuple[Path, Path, Progress]]:
    """One measurement's work directory (with the saved plan) and progress bar.

    Removed afterwards unless --keep; kept, and named in the error, when it failed.
    """
    check_memory(plan, opts.memory)
    workdir = _workdir()
    plan_path = workdir / "plan.json"
    plan.save(plan_path)
    prog = Progress(total, enabled=progress, stream=stream)
    ok = False
    try:
        yield plan_path, workdir, prog
        ok = True
    except BenchError as exc:
        raise BenchError(f"{exc}\n(configs, logs and records kept in {workdir})") from None
    finally:
        prog.close()
        if ok and not opts.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def run(opts: Options, *, progress: bool = True, stream: TextIO | None = None) -> dict[str, Any]:
    """Run the benchmark and return its report (the --json object)."""
    plan = build_plan(opts, "r")
    runs = 1 + len(opts.configs)
    total = runs if opts.small else runs * len(plan.lengths) * (plan.warmup + plan.requests)
    with workspace(opts, plan, total, progress, stream) as (plan_path, workdir, prog):
        report = _header(opts, plan)
        if opts.small:
            _run_small(opts, plan, plan_path, workdir, prog, report)
        else:
            _run_sweep(opts, plan, plan_path, workdir, prog, report)
        report["host"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if opts.keep:
        report["workdir"] = str(workdir)
    return report


def _header(opts: Options, plan: Plan) -> dict[str, Any]:
    g = plan.geometry
    return {
        "kvxferd_version": __version__,
        "mode": plan.mode,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": opts.command,
        "geometry": {
            "layers": g.layers,
            "kv_heads": g.kv_heads,
            "head_dim": g.head_dim,
            "tokens_per_block": g.tokens_per_block,
            "dtype": g.dtype,
            "layout": g.layout,
            "block_bytes": g.block_bytes,
        },
        "tokens": list(plan.lengths),
        "requests": plan.requests,
        "warmup": plan.warmup,
        "in_flight": plan.in_flight,
        "seconds": plan.seconds if opts.small else None,
        "block_order": "shuffled" if opts.shuffle else "sequential",
        "verify": plan.verify,
        "pool_blocks": plan.pool_blocks,
        "configs": [c.name for c in opts.configs],
        # host or vram: where every pool of the run (the raw pair's too) lived.
        "memory": opts.memory,
        "host": host_info(opts.memory),
    }


def _run_sweep(
    opts: Options, plan: Plan, plan_path: Path, workdir: Path, prog: Progress,
    report: dict[str, Any],
) -> None:  # fmt: skip
    g = plan.geometry
    # The ceiling of the memory the pools are in: a host memcpy, or a device-to-device copy.
    copy_gbps = device_copy_gbps if opts.memory == "vram" else memcpy_gbps
    memcpy = {t: copy_gbps(g.request_bytes(t)) for t in plan.lengths}
    report["memcpy"] = [
        {"tokens": t, "bytes": g.request_bytes(t), "gbps": _sig(v)} for t, v in memcpy.items()
    ]

    units = len(plan.lengths) * (plan.warmup + plan.requests)
    prog.start_phase("raw NIXL", units)
    raw = raw_run(plan_path, plan, workdir, prog, opts.timeout_s, opts.memory)
    raw_t: dict[int, Timing] = {}
    report["raw"] = []
    for t in plan.lengths:
        timing = Timing.of(raw_intervals(raw, t), g.request_bytes(t) * plan.requests)
        raw_t[t] = timing
        report["raw"].append(
            {
                "tokens": t,
                "bytes": g.request_bytes(t),
                "descriptors": descriptors(raw, t),
                "gbps": _sig(timing.gbps),
                "p50_ms": _sig(timing.p50_ms),
                "p99_ms": _sig(timing.p99_ms),
            }
        )
    report["raw_verified"] = raw.get("verified", 0)
    prog.end_phase(", ".join(f"{t} tok {raw_t[t].gbps:.2f} GB/s" for t in plan.lengths))

    results: list[dict[str, Any]] = []
    report["results"] = results
    for config in opts.configs:
        bare = _sweep_bare(opts, plan, plan_path, workdir, prog, config, report)
        prog.start_phase(config.name, units)
        gen, ctx = daemon_run(
            config, plan_path, plan, workdir, prog, opts.timeout_s,
            memory=opts.memory, vram_share=opts.vram_share,
        )  # fmt: skip
        report.setdefault("daemon_status", {})[config.name] = gen.pop("daemon_status", {})
        summary = []
        for t in plan.lengths:
            nbytes = g.request_bytes(t)
            intervals = daemon_intervals(gen, ctx, t, nbytes, config.name)
            if len(intervals) != plan.requests:
                raise BenchError(
                    f"{config.name}: {len(intervals)} timed requests of {t} tokens finished, "
                    f"{plan.requests} expected"
                )
            timing = Timing.of(intervals, nbytes * plan.requests)
            rt = raw_t[t]
            results.append(
                {
                    "config": config.name,
                    "tokens": t,
                    "blocks": g.blocks_for(t),
                    "bytes": nbytes,
                    "descriptors": descriptors(raw, t),
                    "requests": timing.count,
                    "verified": timing.count,
                    "gbps": _sig(timing.gbps),
                    "p50_ms": _sig(timing.p50_ms),
                    "p99_ms": _sig(timing.p99_ms),
                    "mean_ms": _sig(timing.mean_ms),
                    "raw_gbps": _sig(rt.gbps),
                    "raw_p50_ms": _sig(rt.p50_ms),
                    "raw_p99_ms": _sig(rt.p99_ms),
                    "ratio_to_raw": _sig(ratio(timing.gbps, rt.gbps)),
                    "memcpy_gbps": _sig(memcpy[t]),
                    "ratio_to_memcpy": _sig(ratio(timing.gbps, memcpy[t])),
                }
                | _bare_fields(bare, t, rt, timing)
                | _cpu_fields(gen, t, nbytes * plan.requests, plan.requests)
            )
            summary.append(f"{t} tok {timing.gbps:.2f} GB/s")
        prog.end_phase(", ".join(summary))
    annotate(report)


def _run_small(
    opts: Options, plan: Plan, plan_path: Path, workdir: Path, prog: Progress,
    report: dict[str, Any],
) -> None:  # fmt: skip
    g = plan.geometry
    nbytes = g.block_bytes
    prog.start_phase("raw NIXL, one-block requests", None, seconds=plan.seconds + _STARTUP_S)
    raw = raw_run(plan_path, plan, workdir, prog, opts.timeout_s, opts.memory)
    raw_iv = raw_intervals(raw, None)
    raw_timing = Timing.of(raw_iv, nbytes * len(raw_iv))
    raw_elapsed = _elapsed(raw_iv, int(raw.get("timed_start_ns", 0)))
    raw_rps = ratio(len(raw_iv), raw_elapsed)
    report["raw"] = {
        "requests": len(raw_iv),
        "seconds": _sig(raw_elapsed),
        "requests_per_s": _sig(raw_rps),
        "p50_ms": _sig(raw_timing.p50_ms),
        "p99_ms": _sig(raw_timing.p99_ms),
    }
    report["raw_verified"] = raw.get("verified", 0)
    prog.end_phase(f"{raw_rps:.0f} requests/s")

    results: list[dict[str, Any]] = []
    report["results"] = results
    for config in opts.configs:
        prog.start_phase(
            f"{config.name}, one-block requests", None, seconds=plan.seconds + _STARTUP_S
        )
        gen, ctx = daemon_run(
            config, plan_path, plan, workdir, prog, opts.timeout_s,
            memory=opts.memory, vram_share=opts.vram_share,
        )  # fmt: skip
        intervals = daemon_intervals(gen, ctx, None, nbytes, config.name)
        if not intervals:
            raise BenchError(f"{config.name}: no timed request finished")
        timing = Timing.of(intervals, nbytes * len(intervals))
        elapsed = _elapsed(intervals, int(gen.get("timed_start_ns", 0)))
        rps = ratio(len(intervals), elapsed)
        results.append(
            {
                "config": config.name,
                "tokens": g.tokens_per_block,
                "bytes": nbytes,
                "requests": len(intervals),
                "verified": len(intervals),
                "seconds": _sig(elapsed),
                "requests_per_s": _sig(rps),
                "p50_ms": _sig(timing.p50_ms),
                "p99_ms": _sig(timing.p99_ms),
                "mean_ms": _sig(timing.mean_ms),
                "raw_requests_per_s": _sig(raw_rps),
                "raw_p50_ms": _sig(raw_timing.p50_ms),
                "raw_p99_ms": _sig(raw_timing.p99_ms),
                "ratio_to_raw": _sig(ratio(rps, raw_rps)),
            }
            | _small_bare_fields(config, rps, timing, raw_rps, raw_timing)
            | _cpu_fields(gen, g.tokens_per_block, nbytes * len(intervals), len(intervals))
        )
        prog.end_phase(f"{rps:.0f} requests/s, p50 {timing.p50_ms:.2f} ms")
    first = results[0]
    for key in ("requests_per_s", "p50_ms", "p99_ms", "raw_requests_per_s", "raw_p50_ms",
                "raw_p99_ms", "ratio_to_raw"):  # fmt: skip
        report[key] = first[key]


# -- each configuration against its own bare transport ----------------------------------------


def _sweep_bare(
    opts: Options, plan: Plan, plan_path: Path, workdir: Path, prog: Progress,
    config: BenchConfig, report: dict[str, Any],
) -> dict[int, tuple[str, Timing, list[int], float | None]] | str | None:  # fmt: skip
    """Run `config`'s staged bare pair (right before the configuration itself): per length
    (bare name, timing, blocks per round, CPU seconds); None when its bare transport is the
    raw NIXL pair; a sentence when it has one that this run cannot measure."""
    spec = bare_run.bare_for(config)
    if spec is None:
        return None
    if opts.memory != "host":
        return f"the {spec.name} pair moves host memory only"
    if plan.in_flight != 1:
        return f"the {spec.name} pair runs one request at a time (--in-flight 1)"
    tokens = bare_run.staging_tokens(config)
    prog.start_phase(f"bare {spec.name}", len(plan.lengths) * (plan.warmup + plan.requests))
    sender = bare_run.run_pair(spec, tokens, plan_path, workdir, prog, opts.timeout_s)
    out = {}
    rows = report.setdefault("bare", [])
    for t in plan.lengths:
        res = bare_run.result_of(sender, plan.geometry, t, plan.requests, spec.name)
        out[t] = (spec.name, res.timing, res.rounds, res.cpu_s)
        moved = plan.geometry.request_bytes(t) * plan.requests
        rows.append(
            {
                "config": config.name,
                "bare": spec.name,
                "tokens": t,
                "bytes": plan.geometry.request_bytes(t),
                "round_blocks": res.rounds,
                "staging_tokens": tokens,
                "gbps": _sig(res.timing.gbps),
                "p50_ms": _sig(res.timing.p50_ms),
                "p99_ms": _sig(res.timing.p99_ms),
                "cpu_s_per_gb": _opt(cpu.per_gb(res.cpu_s, moved)),
                "verified": sender.get("verified", 0),
            }
        )
    prog.end_phase(", ".join(f"{t} tok {v[1].gbps:.2f} GB/s" for t, v in out.items()))
    return out


def _bare_fields(
    bare: dict[int, tuple[str, Timing, list[int], float | None]] | str | None,
    tokens: int,
    raw: Timing,
    timing: Timing,
) -> dict[str, Any]:
    """A sweep row's own-baseline fields: the raw NIXL pair's for the PYTHON runtime, the
    staged pair's for the staged one (None where not measured, `bare_note` says why)."""
    if bare is None:
        name, base, rounds = bare_run.RAW, raw, None
    elif isinstance(bare, str):
        return {"bare": None, "bare_gbps": None, "bare_p50_ms": None, "bare_p99_ms": None,
                "ratio_to_bare": None, "bare_note": bare}  # fmt: skip
    else:
        name, base, rounds, _ = bare[tokens]
    return {
        "bare": name,
        "bare_gbps": _sig(base.gbps),
        "bare_p50_ms": _sig(base.p50_ms),
        "bare_p99_ms": _sig(base.p99_ms),
        "ratio_to_bare": _sig(ratio(timing.gbps, base.gbps)),
    } | ({"bare_round_blocks": rounds} if rounds is not None else {})


def _small_bare_fields(
    config: BenchConfig, rps: float, timing: Timing, raw_rps: float, raw: Timing
) -> dict[str, Any]:
    """--small: the bare request rate is the raw NIXL pair's one-block writes, the own
    baseline of every configuration over NIXL; the others have none here."""
    backend, _ = bare_run.effective(config)
    if backend != "NIXL":
        return {"bare": None, "ratio_to_bare_rate": None, "p50_minus_bare_ms": None,
                "bare_note": f"--small measures no bare {backend.lower()} pair"}  # fmt: skip
    return {
        "bare": bare_run.RAW,
        "bare_requests_per_s": _sig(raw_rps),
        "ratio_to_bare_rate": _sig(ratio(rps, raw_rps)),
        "p50_minus_bare_ms": _sig(timing.p50_ms - raw.p50_ms),
    }


# /proc counts CPU time in clock ticks (10 ms): over less than this, four processes' ticks
# say little about the cores they kept busy, and cores_busy is left out (null).
_CORES_MIN_WALL_S = 1.0


def _cpu_fields(gen: dict[str, Any], tokens: int, moved: int, requests: int) -> dict[str, Any]:
    """Both daemons' CPU seconds over the timed requests (utime + stime, /proc), per GB
    moved and per request; the two engines' per request; and how many of the host's cores
    the four processes kept busy meanwhile (their CPU seconds over the wall time)."""
    spent = bare_run.daemon_cpu_s(gen, tokens)
    engines, wall = bare_run.engine_cpu_s(gen, tokens)
    both = None if spent is None or engines is None else spent + engines
    return {
        "cpu_s": _opt(spent),
        "cpu_s_per_gb": _opt(cpu.per_gb(spent, moved)),
        "cpu_ms_per_request": _opt(None if spent is None or not requests
                                   else spent * 1e3 / requests),
        "engines_cpu_ms_per_request": _opt(None if engines is None or not requests
                                           else engines * 1e3 / requests),
        "cores_busy": _opt(None if both is None or wall < _CORES_MIN_WALL_S else both / wall),
    }  # fmt: skip


def _opt(x: float | None) -> float | None:
    return None if x is None else _sig(x)


def _elapsed(intervals: list[tuple[int, int]], start_ns: int) -> float:
    """Seconds from the start of the timed phase to the last completion."""
    if not intervals:
        return 0.0
    first = start_ns or min(s for s, _ in intervals)
    return (max(e for _, e in intervals) - first) / 1e9


def _sig(x: float, digits: int = 5) -> float:
    """`x` to `digits` significant digits (JSON stays readable, small values keep precision)."""
    return float(f"{x:.{digits}g}")

"""Each configuration's own bare transport: which one, running its pair, and its numbers.

A configuration under the PYTHON runtime writes straight between the pools over NIXL: its
bare transport is the raw NIXL pair (kvxferd.bench.raw, `bare` "nixl"). A configuration
under the staged runtime moves staging rounds over its backend: its bare transport is that
backend moving the same rounds between two contiguous buffers (kvxferd.bench.bare, `bare`
"<backend>-rounds"). The driver runs a configuration's bare pair right before the
configuration itself, so the two are measured as close together as the host allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvxferd.bench import cpu
from kvxferd.bench.children import BenchError, check_report, run_reporting, spawn
from kvxferd.bench.configs import BenchConfig
from kvxferd.bench.plan import Geometry
from kvxferd.bench.progress import Progress
from kvxferd.bench.stats import Timing
from kvxferd.transceiver.staging import DEFAULT_STAGING_TOKENS

#: The bare name of the PYTHON runtime's baseline: the raw NIXL pair.
RAW = "nixl"


@dataclass(frozen=True)
class BareSpec:
    """A staged backend's bare pair: its name in the report and its module."""

    name: str
    module: str
    one_sided: bool


STAGED: dict[str, BareSpec] = {
    "NIXL": BareSpec("nixl-rounds", "kvxferd.bench.bare_nixl", True),
    "UCX": BareSpec("ucx-rounds", "kvxferd.bench.bare_ucx", False),
    "MPI": BareSpec("mpi-rounds", "kvxferd.bench.bare_mpi", False),
    "MOONCAKE": BareSpec("mooncake-rounds", "kvxferd.bench.bare_mooncake", True),
}


def effective(config: BenchConfig) -> tuple[str, str]:
    """(backend, runtime) the daemons resolve `config` to (DEFAULT is NIXL; auto is PYTHON
    over NIXL with a finite timeout, else CPP), as kvxferd.config resolves them."""
    t = config.transceiver
    backend = str(t.get("backend", "DEFAULT"))
    backend = "NIXL" if backend == "DEFAULT" else backend
    runtime = t.get("transceiver_runtime", "auto")
    if runtime is None:
        runtime = "CPP"  # the seed: null means the staged runtime
    if runtime == "auto":
        finite = t.get("kv_transfer_timeout_ms", 1) is not None
        runtime = "PYTHON" if backend == "NIXL" and finite else "CPP"
    return backend, str(runtime)


def bare_for(config: BenchConfig) -> BareSpec | None:
    """The staged pair of `config`, or None: its bare transport is the raw NIXL pair."""
    backend, runtime = effective(config)
    return STAGED.get(backend) if runtime == "CPP" else None


def staging_tokens(config: BenchConfig) -> int:
    """Tokens the daemons' staging regions hold under `config` (kvxferd.service.daemon)."""
    for value in (config.transceiver.get("max_tokens_in_buffer"), config.engine.get("max_seq_len")):
        if value:
            return int(value)
    return DEFAULT_STAGING_TOKENS


def run_pair(
    spec: BareSpec,
    tokens: int,
    plan_path: Path,
    workdir: Path,
    prog: Progress,
    timeout_s: float,
) -> dict[str, Any]:
    """Run `spec`'s receiver and sender over the plan; the sender's report."""
    name = spec.name
    info = workdir / f"{name}-receiver.json"
    common = ["--plan", str(plan_path), "--staging-tokens", str(tokens)]
    receiver = spawn(
        workdir, f"{name}-receiver", ["-m", spec.module, "receiver", *common,
                                      "--info-out", str(info)],
    )  # fmt: skip
    try:
        receiver.wait_for_file(info, f"the bare {name} receiver")
        sender = run_reporting(
            workdir,
            f"{name}-sender",
            ["-m", spec.module, "sender", *common, "--receiver-info", str(info)],
            prog,
            timeout_s,
            partners=[receiver],
        )
        report = sender.report()
        check_report(f"bare {name}", report, "\n" + sender.stderr_tail() + receiver.stderr_tail())
        return report
    finally:
        receiver.reap()  # it ends when the sender hangs up


@dataclass(frozen=True)
class BareResult:
    timing: Timing
    rounds: list[int]
    cpu_s: float | None


def result_of(
    report: dict[str, Any], geometry: Geometry, tokens: int, requests: int, name: str
) -> BareResult:
    """One length's timed requests of a bare pair: latency = the sum of a request's rounds
    (start to done), bandwidth = bytes over the sum of the latencies (one in flight)."""
    per_request: dict[str, list[dict[str, Any]]] = {}
    for r in report.get("records", []):
        if r["timed"] and r["tokens"] == tokens:
            per_request.setdefault(r["request_id"], []).append(r)
    if len(per_request) != requests:
        raise BenchError(
            f"bare {name}: {len(per_request)} timed requests of {tokens} tokens, "
            f"{requests} expected"
        )
    nbytes = geometry.request_bytes(tokens)
    intervals = []
    rounds: list[int] = []
    for rid, recs in per_request.items():
        moved = sum(int(r["nbytes"]) for r in recs)
        if moved != nbytes:
            raise BenchError(f"bare {name}: request {rid} moved {moved} bytes, {nbytes} expected")
        start = min(int(r["t_start_ns"]) for r in recs)
        # Rounds run one after another; between them the untimed fill and verify.
        intervals.append((start, start + sum(int(r["t_done_ns"]) - int(r["t_start_ns"])
                                             for r in recs)))  # fmt: skip
        rounds = [int(r["blocks"]) for r in sorted(recs, key=lambda r: int(r["round"]))]
    cpu_s = None
    for group in report.get("cpu", []):
        if group["timed"] and group["tokens"] == tokens:
            cpu_s = float(group["cpu_s"])
    return BareResult(Timing.of(intervals, nbytes * requests), rounds, cpu_s)


def daemon_cpu_s(gen_report: dict[str, Any], tokens: int) -> float | None:
    """Both daemons' CPU seconds over the timed group of `tokens` (the generation engine
    read /proc at its start and end), or None when it could not."""
    for group in gen_report.get("cpu", []):
        if group["timed"] and group["tokens"] == tokens:
            return cpu.spent(group["start"], group["end"])
    return None


def engine_cpu_s(gen_report: dict[str, Any], tokens: int) -> tuple[float | None, float]:
    """Both engines' CPU seconds over the timed group of `tokens`, and its wall seconds;
    (None, 0) when they were not read."""
    for group in gen_report.get("cpu", []):
        if group["timed"] and group["tokens"] == tokens and "engines_start" in group:
            spent = cpu.spent(group["engines_start"], group["engines_end"])
            return spent, float(group["wall_s"])
    return None, 0.0


def cpu_pids_args(*pids: int) -> list[str]:
    return ["--cpu-pids", ",".join(str(p) for p in pids)]

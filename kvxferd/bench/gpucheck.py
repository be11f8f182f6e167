"""The GPU check of issue 15: one run on one GPU, one JSON file, one verdict.

`python -m kvxferd.bench.gpucheck --out DIR [--budget-s S] [--steps a,b]`, normally through
scripts/gpu-check.sh (which first installs the carried wheels). Steps, each in processes of
its own (kvxferd.bench.gpu_probes) under a time cap, so that a hang costs only its step:

0. setup: versions, the device, NIXL's module, CUDA IPC and VMM smoke tests;
1. device_copy: 1 GiB device-to-device memcpy; batched gather/scatter, 4 KiB and 64 KiB rows;
2. nixl_vram: bare NIXL VRAM->VRAM between two processes, 64 MiB and 1 GiB, bytes checked;
3. foreign_memory: IPC-opened and VMM-imported memory copied into, registered with NIXL as
   VRAM and written (NIXL's refusal is a finding, recorded as its text);
4. kvxferd_bench: `kvxferd bench --memory vram` through two daemons, 8000-token requests.

A global deadline skips what no longer fits instead of overrunning, and DIR/gpu-check.json is
rewritten after every step, so a kill leaves every finished step behind. A figure that was
not measured is null, never 0. Exit status: 0 passed, 1 measured and failed a criterion,
2 incomplete (a step skipped or broke: always so on a host without a GPU).

The pass rule (issue 15): the best kvxferd configuration at 8000 tokens moves at least 0.8x
bare NIXL's 1 GiB VRAM write rate; every gather and scatter rate (both segment sizes, cupy's
take / indexed assignment, which is what the daemon's device copier runs) is at least half the
device's memcpy rate; no request failed.

The driver draws on modules of its own: kvxferd.bench.gpucheck_spec (the steps, their caps, each
step's entry before measurement, the verdict and the exit status), gpucheck_runs (one process
under its cap, with its logs and its `@@gpucheck` results) and gpucheck_summary (what is
printed at the end). This module keeps the check itself (its steps in order, the JSON and the
logs' tarball) and the entry point.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvxferd.bench.gpucheck_runs import ROOT, Run, probe_argv, run_process
from kvxferd.bench.gpucheck_spec import (
    BENCH_CONFIGS,
    BENCH_REQUESTS,
    BENCH_TOKENS,
    BENCH_WARMUP,
    CAPS_S,
    HOST_KEYS,
    JSON_NAME,
    LOG_TAIL,
    LOGS_NAME,
    MIN_STEP_S,
    NO_DEVICE,
    NO_MEMORY_FLAG,
    NO_TIME,
    NOT_SELECTED,
    SCHEMA,
    SEGMENTS,
    SETUP_HOST_KEYS,
    SETUP_STEP_KEYS,
    STEPS,
    ZERO_COPY_CONFIG,
    exit_code,
    skeleton,
    verdict,
)
from kvxferd.bench.gpucheck_spec import get as _get
from kvxferd.bench.gpucheck_summary import summary

# -- the check -------------------------------------------------------------------------------


class Terminated(Exception):
    """SIGTERM (the outer `timeout`) arrived: stop, kill the step's processes, keep the JSON."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def _git() -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    # The device machine receives a copy of the working tree, maybe without .git.
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


class Check:
    def __init__(
        self, out_dir: Path, budget_s: float, steps: Sequence[str], python: str, device: int
    ) -> None:
        self.out_dir = out_dir
        self.python = python
        self.device = device
        self.selected = set(steps)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.logdir = Path(tempfile.mkdtemp(prefix="kvxferd-gpucheck-"))
        self.doc: dict[str, Any] = {
            "schema": SCHEMA,
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "elapsed_s": 0.0,
            "budget_s": budget_s,
            "git": _git(),
            "host": {**dict.fromkeys(HOST_KEYS), "ucx_env": {}},
            "steps": {s: skeleton(s, "not run") for s in STEPS},
            "ratios": None,
            "pass": None,
            "skipped": {},
            "errors": {},
        }
        self.doc["ratios"], self.doc["pass"] = verdict(self.doc["steps"])
        self._seq = 0

    # -- bookkeeping

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def cap(self, step: str, share: float = 1.0) -> float:
        return min(CAPS_S[step] * share, self.left())

    def tag(self, name: str) -> str:
        self._seq += 1
        return f"{self._seq:02d}-{name}"

    def skip(self, step: str, why: str) -> None:
        self.doc["steps"][step] = skeleton(step, why)
        self.doc["skipped"][step] = why

    def error(self, step: str, why: str) -> None:
        self.doc["steps"][step]["status"] = "error: " + why
        self.doc["errors"][step] = why

    def start(self, step: str) -> dict[str, Any]:
        """The step's entry, all null, in the document while it runs."""
        entry = skeleton(step, "running")
        self.doc["steps"][step] = entry
        return entry

    def probe(self, step: str, role: str, *args: str, share: float = 1.0, tag: str = "") -> Run:
        """One probe process for `step` on our device, under (a share of) the step's cap."""
        return run_process(
            probe_argv(self.python, role, *args, "--device", str(self.device)),
            self.cap(step, share),
            self.logdir,
            self.tag(tag or step),
        )

    def settle(self, step: str, run: Run, broken: bool, complete: bool, incomplete: str) -> None:
        """A measuring step's end: an error (the run's why, or `incomplete` when a figure is
        missing) or "ok"; ok only when complete and nothing went wrong."""
        entry = self.doc["steps"][step]
        if broken:
            self.error(step, run.why())
        elif not complete:
            self.error(step, incomplete)
        else:
            entry["status"] = "ok"
        entry["ok"] = complete and step not in self.doc["errors"]

    def write(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.doc["ratios"], self.doc["pass"] = verdict(self.doc["steps"])
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / JSON_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, allow_nan=False) + "\n")
        os.replace(tmp, path)
        self._write_logs()

    def _write_logs(self) -> None:
        path = self.out_dir / LOGS_NAME
        tmp = path.with_name(path.name + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for f in sorted(self.logdir.rglob("*")):
                if not f.is_file():
                    continue
                data = f.read_bytes()[-LOG_TAIL:]
                info = tarfile.TarInfo(str(f.relative_to(self.logdir)))
                info.size = len(data)
                info.mtime = int(f.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, path)

    # -- the steps

    def run(self) -> int:
        try:
            return self._run()
        except Terminated:
            self.doc["errors"]["check"] = "terminated (SIGTERM, the outer timeout) before the end"
            self.write()
            print(summary(self.doc, 124))
            return 124

    def _run(self) -> int:
        setup = self.step_setup()
        gate = None if setup.get("cuda") else NO_DEVICE
        for step in STEPS[1:]:
            if gate:
                self.skip(step, gate)
            elif step not in self.selected:
                self.skip(step, NOT_SELECTED)
            elif self.left() < MIN_STEP_S:
                self.skip(step, NO_TIME)
            else:
                t = time.monotonic()
                try:
                    getattr(self, f"step_{step}")(setup)
                except Exception as exc:  # a bug in this driver must not lose the JSON
                    self.error(step, f"the driver failed: {type(exc).__name__}: {exc}")
                self.doc["steps"][step]["seconds"] = round(time.monotonic() - t, 1)
            self.write()
        self.write()
        code = exit_code(self.doc)
        print(summary(self.doc, code))
        return code

    def step_setup(self) -> dict[str, Any]:
        entry = self.start("setup")
        run = self.probe("setup", "setup")
        r = run.result
        for dest, keys in ((self.doc["host"], SETUP_HOST_KEYS), (entry, SETUP_STEP_KEYS)):
            dest.update((key, r[key]) for key in keys if key in r)
        entry["seconds"] = round(run.seconds, 1)
        entry["cuda"] = bool(r.get("cuda"))
        if run.failed:
            self.error("setup", run.why())
            entry["cuda"] = False
            entry["why"] = entry.get("why") or f"setup probe {run.why()}"
        problems = []
        if not entry["cuda"]:
            problems.append(entry.get("why") or "no CUDA device")
        if not r.get("nixl_module"):
            problems.append(f"NIXL does not import ({r.get('nixl_error', 'not checked')})")
        bad = {k: v for k, v in (r.get("imports") or {}).items() if v != "ok"}
        if bad:
            problems.append("imports failed: " + "; ".join(f"{k}: {v}" for k, v in bad.items()))
        if entry["cuda"]:
            for smoke in ("ipc_smoke", "vmm_smoke"):
                if entry.get(smoke) != "ok":
                    problems.append(f"{smoke}: {entry.get(smoke)}")
        entry["ok"] = not problems and "setup" not in self.doc["errors"]
        entry["why"] = "; ".join(problems) if problems else None
        if "setup" not in self.doc["errors"]:
            entry["status"] = "ok" if entry["ok"] else "failed"
        entry["nixl_module"] = r.get("nixl_module")
        self.write()
        return entry

    def step_device_copy(self, setup: dict[str, Any]) -> None:
        entry = self.start("device_copy")
        run = self.probe("device_copy", "device_copy")
        r = run.result
        entry["memcpy"] = r.get("memcpy")
        entry["memcpy_gbps"] = _get(r, "memcpy", "gbps")
        verified = [_get(r, "memcpy", "verified")]
        for way in ("gather", "scatter"):
            for seg in SEGMENTS:
                got = _get(r, way, seg) or {}
                cupy, kernel = got.get("cupy"), got.get("kernel")
                e = entry[way][seg]
                e["segments"] = got.get("segments")
                e["cupy"] = cupy
                e["cupy_gbps"] = _get(cupy, "gbps")
                e["verified"] = _get(cupy, "verified")
                # The daemon's row kernel: the verdict judges it where it ran right (else
                # take, which the daemon falls back to); an error there is its text.
                e["kernel"] = kernel
                e["kernel_gbps"] = _get(kernel, "gbps")
                e["kernel_verified"] = _get(kernel, "verified")
                verified.append(e["verified"])
        complete = entry["memcpy_gbps"] is not None and all(v is True for v in verified)
        self.settle(
            "device_copy",
            run,
            run.failed,
            complete,
            "a copy was unmeasured or its bytes came out wrong",
        )

    def step_nixl_vram(self, setup: dict[str, Any]) -> None:
        if not setup.get("nixl_module"):
            self.skip("nixl_vram", "skipped: NIXL does not import")
            return
        entry = self.start("nixl_vram")
        run = self.probe("nixl_vram", "nixl_vram")
        r = run.result
        entry["module"] = r.get("module")
        for label in ("64MiB", "1GiB"):
            got = _get(r, "writes", label)
            if got:
                entry["writes"][label] = got
        writes = entry["writes"].values()
        complete = all(w.get("gbps") is not None and w.get("verified") is True for w in writes)
        self.settle(
            "nixl_vram",
            run,
            run.broken,
            complete,
            "a write size was unmeasured or its bytes came out wrong",
        )

    def step_foreign_memory(self, setup: dict[str, Any]) -> None:
        entry = self.start("foreign_memory")
        problems = []
        for kind in ("ipc", "vmm"):
            sub = entry[kind]
            if setup.get(f"{kind}_smoke") != "ok":
                sub["status"] = (
                    f"skipped: the {kind} smoke test failed ({setup.get(f'{kind}_smoke')})"
                )
                problems.append(f"{kind}: {sub['status']}")
                continue
            if self.left() < MIN_STEP_S:
                sub["status"] = NO_TIME
                problems.append(f"{kind}: {NO_TIME}")
                continue
            run = self.probe(
                "foreign_memory", "foreign", "--kind", kind, share=0.5, tag=f"foreign-{kind}"
            )
            for key, value in run.result.items():
                if key != "kind":
                    sub[key] = value
            if run.broken:
                sub["status"] = "error: " + run.why()
                problems.append(f"{kind}: {run.why()}")
            else:
                # A refused registration is a measured answer, not a broken step.
                sub["status"] = "ok"
            self.write()
        if problems:
            self.error("foreign_memory", "; ".join(problems))
        else:
            entry["status"] = "ok"
        entry["ok"] = not problems

    def step_kvxferd_bench(self, setup: dict[str, Any]) -> None:
        if not setup.get("nixl_module"):
            self.skip("kvxferd_bench", "skipped: NIXL does not import")
            return
        cli = [self.python, "-m", "kvxferd.cli", "bench"]
        try:
            # Within what is left, so that a hung --help cannot run past the budget.
            helped = subprocess.run(
                [*cli, "--help"],
                capture_output=True,
                text=True,
                timeout=max(1.0, min(60.0, self.left())),
                cwd=ROOT,
            )
            help_text = helped.stdout
        except (OSError, subprocess.SubprocessError) as exc:
            self.start("kvxferd_bench")
            self.error("kvxferd_bench", f"kvxferd bench --help failed: {exc}")
            return
        if "--memory" not in help_text:
            self.skip("kvxferd_bench", NO_MEMORY_FLAG)
            return
        entry = self.start("kvxferd_bench")
        configs = [c for c in BENCH_CONFIGS if c in help_text]
        foreign = self.doc["steps"]["foreign_memory"]
        if ZERO_COPY_CONFIG in help_text and any(
            _get(foreign, k, "register") == "ok" for k in ("ipc", "vmm")
        ):
            configs.append(ZERO_COPY_CONFIG)
        cap = self.cap("kvxferd_bench")
        argv = [
            *cli,
            "--memory",
            "vram",
            "--tokens",
            str(BENCH_TOKENS),
            "--requests",
            str(BENCH_REQUESTS),
            "--warmup",
            str(BENCH_WARMUP),
            "--json",
            "--no-progress",
            "--keep",
            "--timeout",
            str(max(30, int(cap / 2))),
        ]
        if configs:
            argv += ["--configs", ",".join(configs)]
        entry["command"] = " ".join(argv[1:])
        run = run_process(argv, cap, self.logdir, self.tag("kvxferd_bench"))
        report = _bench_report(run.stdout)
        if report is not None:
            self._keep_bench_logs(report.get("workdir"))
            planned = int(report.get("requests", BENCH_REQUESTS))
            for res in report.get("results", []):
                if res.get("tokens") != BENCH_TOKENS:
                    continue
                entry["request_bytes"] = res.get("bytes")
                verified = res.get("verified")
                entry["configs"][res["config"]] = {
                    "gbps": res.get("gbps"),
                    "p50_ms": res.get("p50_ms"),
                    "p99_ms": res.get("p99_ms"),
                    "requests": res.get("requests"),
                    "verified": verified,
                    "failed": planned - verified if isinstance(verified, int) else None,
                    "raw_gbps": res.get("raw_gbps"),
                    "ratio_to_raw": res.get("ratio_to_raw"),
                }
            entry["memory"] = report.get("memory")
            entry["host"] = report.get("host")
        # The bench stops at a failed request (BenchError), so how many failed is unknown: the
        # configurations it did not finish stay out, and the verdict fails.
        self.settle(
            "kvxferd_bench",
            run,
            run.failed or report is None,
            bool(entry["configs"]),
            f"the bench reported no {BENCH_TOKENS}-token results",
        )

    def _keep_bench_logs(self, workdir: Any) -> None:
        if not isinstance(workdir, str) or not os.path.isdir(workdir):
            return
        dest = self.logdir / "bench-workdir"
        dest.mkdir(exist_ok=True)
        kept = 0
        for f in sorted(Path(workdir).rglob("*")):
            if kept >= 40:
                break
            if f.is_file() and f.suffix in (".log", ".err", ".out", ".txt", ".yaml", ".json"):
                data = f.read_bytes()[-LOG_TAIL // 4 :]
                name = str(f.relative_to(workdir)).replace("/", "__")
                (dest / name).write_bytes(data)
                kept += 1


def _bench_report(stdout: str) -> dict[str, Any] | None:
    text = stdout.strip()
    start = text.find("{")
    if start < 0:
        return None
    try:
        report = json.loads(text[start:])
    except json.JSONDecodeError:
        return None
    return report if isinstance(report, dict) else None


# -- entry -----------------------------------------------------------------------------------


def _steps(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    for name in names:
        if name not in STEPS:
            raise argparse.ArgumentTypeError(f"unknown step {name!r}; steps: {', '.join(STEPS)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvxferd.bench.gpucheck",
        description="The GPU check of issue 15 (see docs/benchmarks.md, 'GPU check').",
    )
    p.add_argument("--out", required=True, type=Path, help="directory for gpu-check.json")
    p.add_argument("--budget-s", type=float, default=450.0, help="whole check, seconds")
    p.add_argument(
        "--steps", type=_steps, default=list(STEPS), help="comma-separated; setup always runs"
    )
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    p.add_argument("--python", default=sys.executable, help="the Python the probes run in")
    args = p.parse_args(argv)
    check = Check(args.out, args.budget_s, args.steps, args.python, args.device)
    signal.signal(signal.SIGTERM, _on_sigterm)
    return check.run()


if __name__ == "__main__":
    sys.exit(main())

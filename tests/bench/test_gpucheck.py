"""The GPU check's driver on this CPU-only host, its verdict, and its probes' plumbing.

Nothing here runs on a GPU: the check must say so (exit 2, every figure null) and the
verdict's arithmetic is checked on synthetic figures."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvxferd.bench import gpucheck_runs, gpucheck_spec, gpucheck_summary, probe_io
from kvxferd.bench.gpucheck_spec import NO_DEVICE, STEPS, exit_code, skeleton, verdict

ROOT = Path(__file__).resolve().parents[2]


def _run_check(out: Path, env_path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = None
    if env_path is not None:
        import os

        env = {**os.environ, "PYTHONPATH": f"{env_path}:{ROOT}"}
    return subprocess.run(
        [sys.executable, "-m", "kvxferd.bench.gpucheck", "--out", str(out), "--budget-s", "60"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


def _nulls(d: Any) -> list[Any]:
    """Every leaf under keys that hold figures (gbps, ms, verified)."""
    out = []
    if isinstance(d, dict):
        for k, v in d.items():
            if isinstance(v, (dict, list)):
                out += _nulls(v)
            elif k.endswith(("_gbps", "gbps", "_ms", "verified")):
                out.append(v)
    return out


def _assert_no_gpu_doc(doc: dict[str, Any], why_starts: str) -> None:
    assert doc["schema"] == "kvxferd-gpu-check/1"
    assert set(doc["steps"]) == set(STEPS)
    setup = doc["steps"]["setup"]
    assert setup["ok"] is False and setup["cuda"] is False
    assert setup["why"].startswith(why_starts), setup["why"]
    for step in STEPS[1:]:
        assert doc["steps"][step]["status"] == NO_DEVICE
        assert doc["skipped"][step] == NO_DEVICE
        assert doc["steps"][step]["ok"] is False
    figures = _nulls({k: v for k, v in doc["steps"].items() if k != "setup"})
    assert figures and all(v is None for v in figures)
    assert doc["pass"]["all"] is False
    assert not any(doc["pass"].values())
    assert doc["ratios"]["kvxferd_vs_nixl_1gib"] is None
    assert doc["host"]["python"]


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_check_without_cupy_says_why_and_exits_2(tmp_path: Path) -> None:
    proc = _run_check(tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    _assert_no_gpu_doc(doc, "cupy does not import")
    assert doc["elapsed_s"] < 60
    assert "exit 2" in proc.stdout and "not passed" in proc.stdout
    with tarfile.open(tmp_path / "gpu-check-logs.tar.gz") as tar:
        assert any(n.endswith("setup.out") for n in tar.getnames())


def test_check_with_cupy_but_no_device(tmp_path: Path) -> None:
    # A stand-in cupy that imports and fails as cupy-cuda12x does on a host without a driver.
    fake = tmp_path / "fake"
    (fake / "cupy" / "cuda").mkdir(parents=True)
    (fake / "cupy" / "__init__.py").write_text('__version__ = "0.0-stand-in"\nfrom . import cuda\n')
    (fake / "cupy" / "cuda" / "__init__.py").write_text(
        textwrap.dedent(
            """
            class CUDARuntimeError(RuntimeError):
                pass

            class runtime:
                @staticmethod
                def getDeviceCount():
                    raise CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is "
                                           "insufficient for CUDA runtime version")
            """
        )
    )
    out = tmp_path / "out"
    proc = _run_check(out, str(fake))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    doc = json.loads((out / "gpu-check.json").read_text())
    _assert_no_gpu_doc(doc, "no usable CUDA device: CUDARuntimeError: cudaErrorInsufficientDriver")
    assert doc["host"]["cupy"] == "0.0-stand-in"


# -- the verdict on synthetic figures --------------------------------------------------------


def _steps(
    kvxferd: float | None = 80.0,
    nixl: float | None = 100.0,
    memcpy: float | None = 1000.0,
    copy: float | None = 600.0,
    failed: list[int | None] | None = None,
) -> dict[str, Any]:
    steps = {s: skeleton(s, "ok") for s in STEPS}
    steps["device_copy"]["memcpy_gbps"] = memcpy
    for way in ("gather", "scatter"):
        for seg in ("4096", "65536"):
            steps["device_copy"][way][seg]["cupy_gbps"] = copy
    steps["nixl_vram"]["writes"]["1GiB"]["gbps"] = nixl
    counts = [0, 0] if failed is None else failed
    # config-0 is the best; the others move a tenth as fast (or are unmeasured with it).
    slower = None if kvxferd is None else kvxferd / 10
    steps["kvxferd_bench"]["configs"] = {
        f"config-{i}": {"gbps": kvxferd if i == 0 else slower, "raw_gbps": 90.0, "failed": f}
        for i, f in enumerate(counts)
    }
    return steps


def _doc(steps: dict[str, Any]) -> dict[str, Any]:
    ratios, passed = verdict(steps)
    return {"steps": steps, "ratios": ratios, "pass": passed, "skipped": {}, "errors": {}}


def test_verdict_passes_at_0_80_of_bare_nixl() -> None:
    ratios, passed = verdict(_steps(kvxferd=80.0, nixl=100.0))
    assert ratios["kvxferd_vs_nixl_1gib"] == 0.8
    assert ratios["best_config"] == "config-0"
    assert ratios["kvxferd_vs_bench_raw"] == round(80 / 90, 4)
    assert ratios["kvxferd_vs_memcpy"] == 0.08
    assert passed == {
        "kvxferd_ge_0_8_nixl": True,
        "gather_scatter_ge_half_copy": True,
        "no_failed_requests": True,
        "all": True,
    }
    assert exit_code(_doc(_steps())) == 0


def test_verdict_fails_at_0_79_of_bare_nixl() -> None:
    ratios, passed = verdict(_steps(kvxferd=79.0, nixl=100.0))
    assert ratios["kvxferd_vs_nixl_1gib"] == 0.79
    assert passed["kvxferd_ge_0_8_nixl"] is False and passed["all"] is False
    assert passed["gather_scatter_ge_half_copy"] and passed["no_failed_requests"]
    assert exit_code(_doc(_steps(kvxferd=79.0))) == 1


def test_verdict_gather_scatter_at_half_the_copy_rate() -> None:
    assert verdict(_steps(copy=500.0))[1]["gather_scatter_ge_half_copy"] is True
    steps = _steps(copy=500.0)
    steps["device_copy"]["scatter"]["4096"]["cupy_gbps"] = 499.0
    ratios, passed = verdict(steps)
    assert ratios["scatter_vs_memcpy"]["4096"] == 0.499
    assert passed["gather_scatter_ge_half_copy"] is False and passed["all"] is False


def test_verdict_judges_the_row_kernel_where_it_ran_right_else_take() -> None:
    steps = _steps(copy=400.0)  # take under half the copy rate
    for way in ("gather", "scatter"):
        for seg in ("4096", "65536"):
            e = steps["device_copy"][way][seg]
            e["kernel_gbps"], e["kernel_verified"] = 900.0, True
    ratios, passed = verdict(steps)
    assert ratios["gather_vs_memcpy"] == {"4096": 0.9, "65536": 0.9}
    assert passed["gather_scatter_ge_half_copy"] is True
    # One kernel copy with wrong bytes: that one is judged by take, the daemon's fallback.
    steps["device_copy"]["scatter"]["65536"]["kernel_verified"] = False
    ratios, passed = verdict(steps)
    assert ratios["scatter_vs_memcpy"]["65536"] == 0.4
    assert passed["gather_scatter_ge_half_copy"] is False


@pytest.mark.parametrize(
    "steps",
    [
        _steps(kvxferd=None),
        _steps(nixl=None),
        _steps(memcpy=None),
        _steps(copy=None),
        _steps(failed=[0, None]),
        _steps(failed=[]),
    ],
    ids=["kvxferd", "nixl", "memcpy", "gather", "failed-count", "no-configs"],
)
def test_verdict_a_null_figure_fails_and_is_incomplete(steps: dict[str, Any]) -> None:
    _, passed = verdict(steps)
    assert passed["all"] is False
    assert exit_code(_doc(steps)) == 2


def test_verdict_one_failed_request_fails() -> None:
    _, passed = verdict(_steps(failed=[0, 1]))
    assert passed["no_failed_requests"] is False and passed["all"] is False
    assert passed["kvxferd_ge_0_8_nixl"] and passed["gather_scatter_ge_half_copy"]
    assert exit_code(_doc(_steps(failed=[0, 1]))) == 1


def test_exit_code_is_2_when_anything_was_skipped_or_broke() -> None:
    doc = _doc(_steps())
    doc["skipped"]["kvxferd_bench"] = gpucheck_spec.NO_MEMORY_FLAG
    assert exit_code(doc) == 2
    doc = _doc(_steps())
    doc["errors"]["foreign_memory"] = "vmm: timed out"
    assert exit_code(doc) == 2


def test_summary_prints_every_step_and_the_rule() -> None:
    doc = _doc(_steps())
    doc.update(schema=gpucheck_spec.SCHEMA, elapsed_s=1.0, host={"gpu": "stand-in"})
    text = gpucheck_summary.summary(doc, 0)
    for step in STEPS:
        assert step in text
    assert "need >= 0.8" in text and "need >= 0.5" in text and "all: PASS" in text


# -- the probes' plumbing (no device needed) -------------------------------------------------


def test_pattern_fill_and_check_on_numpy() -> None:
    buf = np.zeros(4096, dtype=np.uint8)
    probe_io.fill(np, buf, 7)
    assert probe_io.holds(np, buf, 7)
    assert not probe_io.holds(np, buf, 8)
    words = buf.view(np.uint64)
    assert len(set(words.tolist())) == words.size  # every word differs
    other = np.zeros_like(buf)
    probe_io.fill(np, other, 8)
    assert not (other.view(np.uint64) == words).any()  # so does every word across seeds
    buf[4095] ^= 1
    assert not probe_io.holds(np, buf, 7)
    assert probe_io.holds(np, buf, 7, 4088)


def test_rate_and_percentiles() -> None:
    r = probe_io.rate(10**9, [1.0, 2.0, 4.0])
    assert r == {"gbps": 500.0, "best_gbps": 1000.0, "p50_ms": 2.0, "p99_ms": 4.0, "runs": 3}
    assert probe_io.rate(10**9, [])["gbps"] is None
    assert probe_io.percentile(list(range(1, 101)), 99) == 99.0


def test_child_protocol_skips_noise_and_times_out() -> None:
    script = textwrap.dedent(
        """
        import json, sys
        print("UCX  WARN  some noise on stdout", flush=True)
        print('@@gpucheck {"ready": true}', flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "echo":
                print("@@gpucheck " + json.dumps({"echo": cmd["x"]}), flush=True)
            if cmd["cmd"] == "fail":
                print('@@gpucheck {"error": "it broke"}', flush=True)
            # "hang": no answer
        """
    )
    child = probe_io.Child("stand-in", [sys.executable, "-c", script])
    try:
        assert child.answer(10) == {"ready": True}
        assert child.ask({"cmd": "echo", "x": 5}) == {"echo": 5}
        with pytest.raises(probe_io.ProbeError, match="it broke"):
            child.ask({"cmd": "fail"})
        with pytest.raises(probe_io.ProbeError, match="no answer in time"):
            child.ask({"cmd": "hang"}, timeout_s=0.3)
    finally:
        child.close()
    assert child.proc.returncode == 0


def test_run_process_keeps_partial_results_of_a_probe_killed_at_its_cap(tmp_path: Path) -> None:
    script = (
        "import time; print('@@gpucheck {\"a\": 1}', flush=True); "
        "print('@@gpucheck {\"b\": 2}', flush=True); time.sleep(60)"
    )
    run = gpucheck_runs.run_process([sys.executable, "-c", script], 1.0, tmp_path, "stand-in")
    assert run.timed_out and run.seconds < 20
    assert run.result == {"a": 1, "b": 2}
    assert run.why().startswith("timed out after")
    assert (tmp_path / "stand-in.out").exists()

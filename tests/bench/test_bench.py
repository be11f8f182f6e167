"""`kvxferd bench` end to end, in tiny configurations: the JSON's shape and sanity, the
table, --small, --plot, and the usage errors. No timing is asserted: only that values are
present, positive and consistent with the geometry."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from cli_harness import kvxferd

pytest.importorskip("nixl_cu12", reason="the bench runs real daemons over NIXL")

TINY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tokens-per-block", "32"]
# 2 layers x 2 (K, V) x 32 tokens x 2 heads x 16 x 2 bytes
BLOCK_BYTES = 2 * 2 * 32 * 2 * 16 * 2

RESULT_KEYS = {
    "config", "tokens", "bytes", "gbps", "p50_ms", "p99_ms", "raw_gbps", "ratio_to_raw",
    "memcpy_gbps", "ratio_to_memcpy", "blocks", "requests", "verified",
}  # fmt: skip
SMALL_KEYS = {"requests_per_s", "p50_ms", "p99_ms", "raw_requests_per_s"}


def bench(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return kvxferd("bench", *args, timeout=timeout, env=env)


def check_header(report: dict[str, Any]) -> None:
    assert report["geometry"]["block_bytes"] == BLOCK_BYTES
    assert report["geometry"]["layers"] == 2
    host = report["host"]
    assert host["cpu_count"] >= 1
    assert host["python"].count(".") == 2
    assert host["nixl_version"] not in ("", "not installed")


def check_cpu(r: dict[str, Any], moved: int) -> None:
    """Both daemons' CPU seconds over the timed requests, per GB and per request."""
    assert r["cpu_s"] is not None and r["cpu_s"] >= 0
    assert r["cpu_s_per_gb"] == pytest.approx(r["cpu_s"] / (moved / 1e9), rel=1e-3)
    assert r["cpu_ms_per_request"] == pytest.approx(r["cpu_s"] * 1e3 / r["requests"], rel=1e-3)
    # The engines' CPU too, and the cores all four kept busy: at most every core there is
    # (clock ticks of 10 ms round each process's seconds, hence the slack), and only for a
    # timed phase of a second or more.
    assert r["engines_cpu_ms_per_request"] is not None and r["engines_cpu_ms_per_request"] >= 0
    if r["cores_busy"] is not None:
        assert 0 <= r["cores_busy"] <= (os.cpu_count() or 1) + 0.2


@pytest.mark.timeout(120)
def test_sweep_json_shape_and_values(tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    proc = bench(
        *TINY, "--tokens", "33,100", "--requests", "2", "--warmup", "1", "--json",
        "--plot", str(plot),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # exactly one JSON object on stdout
    check_header(report)
    assert report["mode"] == "sweep"
    assert report["tokens"] == [33, 100]
    results = report["results"]
    assert [(r["config"], r["tokens"]) for r in results] == [
        ("nixl-python", 33),
        ("nixl-python", 100),
    ]
    for r in results:
        assert set(r) >= RESULT_KEYS, RESULT_KEYS - set(r)
        blocks = -(-r["tokens"] // 32)
        assert r["blocks"] == blocks
        assert r["bytes"] == blocks * BLOCK_BYTES
        assert r["requests"] == r["verified"] == 2
        for key in ("gbps", "raw_gbps", "memcpy_gbps", "ratio_to_raw", "ratio_to_memcpy",
                    "p50_ms", "p99_ms"):  # fmt: skip
            assert r[key] > 0, (key, r)
        assert r["p99_ms"] >= r["p50_ms"]
        assert r["ratio_to_raw"] == pytest.approx(r["gbps"] / r["raw_gbps"], rel=1e-3)
        assert r["ratio_to_memcpy"] == pytest.approx(r["gbps"] / r["memcpy_gbps"], rel=1e-3)
        # The PYTHON runtime's own bare transport is the raw NIXL pair.
        assert r["bare"] == "nixl" and r["bare_gbps"] == r["raw_gbps"]
        assert r["ratio_to_bare"] == r["ratio_to_raw"]
        check_cpu(r, r["bytes"] * r["requests"])
    assert [r["tokens"] for r in report["raw"]] == [33, 100]
    assert report["raw_verified"] >= 1
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_sweep_table_layer_major_in_flight() -> None:
    proc = bench(
        *TINY, "--layout", "layer-major", "--tokens", "40", "--requests", "3", "--warmup", "0",
        "--in-flight", "2", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "layer-major" in out
    assert "nixl-python" in out and "vs raw" in out and "vs bare" in out and "CPU s/GB" in out
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
def test_every_available_configuration_in_one_run() -> None:
    from kvxferd.bench.configs import REGISTRY

    names = [c.name for c in REGISTRY if c.unavailable() is None]
    assert names[:3] == ["nixl-python", "nixl-python-bounce", "nixl-python-pipelined"]
    proc = bench(
        *TINY, "--layout", "layer-major", "--tokens", "600", "--requests", "1", "--warmup", "1",
        "--configs", ",".join(names), "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["configs"] == names
    assert [r["config"] for r in report["results"]] == names
    bare = {row["config"]: row for row in report["bare"]}
    for r in report["results"]:
        assert r["bytes"] == 19 * BLOCK_BYTES and r["verified"] == 1 and r["gbps"] > 0
        # Each configuration against its own transport, measured in this run; bare NIXL
        # (the raw pair) kept beside it.
        staged = r["config"].endswith("-cpp")
        backend = r["config"].split("-")[0]
        assert r["bare"] == (f"{backend}-rounds" if staged else "nixl")
        assert r["ratio_to_bare"] == pytest.approx(r["gbps"] / r["bare_gbps"], rel=1e-3)
        assert r["ratio_to_raw"] == pytest.approx(r["gbps"] / r["raw_gbps"], rel=1e-3)
        check_cpu(r, r["bytes"])
        if staged:
            row = bare[r["config"]]
            assert row["bare"] == r["bare"] and row["gbps"] == r["bare_gbps"]
            assert sum(row["round_blocks"]) == 19 == sum(r["bare_round_blocks"])
            assert row["verified"] == 2 * len(row["round_blocks"])  # warm-up + timed
        else:
            assert r["bare_gbps"] == r["raw_gbps"]
    assert set(bare) == {n for n in names if n.endswith("-cpp")}


@pytest.mark.timeout(120)
def test_small_json_shape() -> None:
    proc = bench(*TINY, "--small", "--seconds", "2", "--in-flight", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    check_header(report)
    assert report["mode"] == "small"
    assert set(report) >= SMALL_KEYS
    assert report["requests_per_s"] > 0 and report["raw_requests_per_s"] > 0
    assert 0 < report["p50_ms"] <= report["p99_ms"]
    (r,) = report["results"]
    assert r["config"] == "nixl-python"
    assert r["bytes"] == BLOCK_BYTES
    assert r["requests"] == r["verified"] > 0
    assert r["requests_per_s"] == report["requests_per_s"]
    assert r["bare"] == "nixl" and r["bare_requests_per_s"] == r["raw_requests_per_s"]
    assert r["ratio_to_bare_rate"] == pytest.approx(
        r["requests_per_s"] / r["raw_requests_per_s"], rel=1e-3
    )
    assert r["p50_minus_bare_ms"] == pytest.approx(r["p50_ms"] - r["raw_p50_ms"], abs=1e-3)
    check_cpu(r, r["bytes"] * r["requests"])
    assert r["cores_busy"] is not None  # two timed seconds: long enough to say


@pytest.mark.timeout(120)
def test_wrong_bytes_fail_the_run() -> None:
    from kvxferd.bench.engine import CORRUPT_ENV

    # A failed run keeps its work directory under TMPDIR: give it one of its own, short
    # enough for the daemons' Unix socket paths (pytest's tmp_path is not), and remove it.
    tmp = tempfile.mkdtemp(prefix="kvb-")
    try:
        proc = bench(
            *TINY, "--tokens", "40", "--requests", "1", "--warmup", "0", "--json",
            env={CORRUPT_ENV: "1", "TMPDIR": tmp},
        )  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 1, proc.stderr
    assert "verification failed: logical block 0" in proc.stderr
    assert "expected 0x" in proc.stderr
    assert f"logs and records kept in {tmp}" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.timeout(120)
def test_small_with_slot_verification_checks_each_slot_once_per_group() -> None:
    """--verify slot: the raw pair's content discipline. Every request still counts as
    verified (by its slot's check at the group's end) and the header says which way."""
    proc = bench(*TINY, "--small", "--seconds", "2", "--in-flight", "4", "--verify", "slot",
                 "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["verify"] == "slot"
    (r,) = report["results"]
    assert r["requests"] == r["verified"] > 0
    text = bench(*TINY, "--small", "--seconds", "1", "--in-flight", "2", "--verify", "slot",
                 "--no-progress")  # fmt: skip
    assert text.returncode == 0, text.stderr
    assert "verify    each slot's blocks filled and checked once per group" in text.stdout


@pytest.mark.timeout(120)
def test_slot_verification_still_catches_wrong_bytes() -> None:
    from kvxferd.bench.engine import CORRUPT_ENV

    tmp = tempfile.mkdtemp(prefix="kvb-")
    try:
        proc = bench(
            *TINY, "--small", "--seconds", "1", "--in-flight", "2", "--verify", "slot",
            "--json", env={CORRUPT_ENV: "1", "TMPDIR": tmp},
        )  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 1, proc.stderr
    assert "slot 0" in proc.stderr and "verification failed: logical block 0" in proc.stderr
    assert proc.stdout == ""


def test_pipeline_compare_refuses_slot_verification() -> None:
    proc = bench(*TINY, "--pipeline-compare", "--verify", "slot", timeout=30)
    assert proc.returncode == 2
    assert "--pipeline-compare times each request's prefill chunk by chunk" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "UCX", "--runtime", "PYTHON"],
         "--runtime PYTHON moves KV over NIXL only; --backend UCX runs with --runtime CPP"),
        (["--backend", "UCX", "--configs", "nixl-python"],
         "give one or the other"),
        (["--configs", "nixl-python,bogus"],
         "unknown configuration 'bogus'; known configurations: nixl-python, nixl-python-bounce"),
    ],
)  # fmt: skip
def test_config_errors_are_usage_errors(args: list[str], message: str) -> None:
    proc = bench(*TINY, *args, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokens", "10,x"], "--tokens: 'x' is not an integer"),
        (["--tokens", "0"], "request lengths must be positive"),
        (["--in-flight", "0"], "--in-flight must be at least 1"),
        (["--dtype", "float16", "--layers", "-1"], "--layers must be at least 1"),
    ],
)
def test_bad_values_are_usage_errors(args: list[str], message: str) -> None:
    proc = bench(*args, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_lists_configurations() -> None:
    proc = bench("--help", timeout=30)
    assert proc.returncode == 0
    for name in ("nixl-python", "nixl-python-bounce", "nixl-python-pipelined", "nixl-cpp",
                 "ucx-cpp", "mpi-cpp", "mooncake-cpp"):  # fmt: skip
        assert name in proc.stdout

"""`kvxferd demo` as a user runs it: real daemons and engines, JSON summary, exit status."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("nixl_cu12", reason="the demo needs NIXL (scripts/install.sh)")


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvxferd.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_json_summary_verifies_every_request() -> None:
    proc = _demo("--requests", "24", "--max-tokens", "700", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    for key in ("requests", "verified", "failed", "bytes", "gbps", "p50_ms", "p99_ms"):
        assert key in summary, key
    assert summary["requests"] == 24
    assert summary["verified"] == 24 and summary["failed"] == 0
    assert summary["bytes"] > 0 and summary["gbps"] > 0
    assert 0 < summary["p50_ms"] <= summary["p99_ms"]
    assert summary["daemon_exit_codes"] == {"demo-ctx": 0, "demo-gen": 0}


def test_demo_table_summary() -> None:
    proc = _demo("--requests", "8", "--max-tokens", "300", "--layout", "layer-major")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"verified\s+8\b", proc.stdout), proc.stdout
    assert re.search(r"failed\s+0\b", proc.stdout), proc.stdout
    assert "GB/s" in proc.stdout and "p99" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx-cu12 not installed")
def test_demo_staged_runtime_over_ucx() -> None:
    proc = _demo("--requests", "8", "--max-tokens", "300", "--backend", "UCX", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["verified"] == 8 and summary["failed"] == 0


def test_demo_with_an_unavailable_backend_fails_clearly() -> None:
    proc = _demo("--requests", "2", "--backend", "MOONCAKE", "--json")
    assert proc.returncode != 0
    assert "backend MOONCAKE is not available" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr

"""`kvxferd demo` as a user runs it: real daemons and engines, JSON summary, exit status."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_harness import kvxferd
from nixl_harness import nixl_or_skip

nixl_or_skip("the demo needs NIXL (scripts/install.sh)")


def _demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return kvxferd("demo", *args, timeout=300, env=env)


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
    assert summary["peer_channel"] == ["plain TCP"], summary["peer_channel"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="mutual TLS needs Python 3.11")
def test_demo_with_mutual_tls() -> None:
    proc = _demo("--requests", "12", "--max-tokens", "500", "--tls")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"verified\s+12\b", proc.stdout), proc.stdout
    assert re.search(r"peers\s+TLSv1\.3 ", proc.stdout), proc.stdout
    assert "with mutual TLS" in proc.stderr


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


def test_demo_with_an_unavailable_backend_fails_clearly(tmp_path: Path) -> None:
    # A package that does not load, as on a host where Mooncake's system libraries are
    # missing: a `mooncake` package earlier on the path that fails to import.
    shadow = tmp_path / "mooncake"
    shadow.mkdir()
    (shadow / "__init__.py").write_text(
        'raise ImportError("libibverbs.so.1: cannot open shared object file")\n'
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = _demo("--requests", "2", "--backend", "MOONCAKE", "--json", env=env)
    assert proc.returncode != 0
    out = proc.stderr + proc.stdout
    assert "backend MOONCAKE's engine (mooncake-transfer-engine-non-cuda) does not load" in out
    assert "libibverbs.so.1" in out and "scripts/system-deps.sh" in out
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("backend", ["NIXL", "MOONCAKE"])
def test_staged_rounds_of_large_blocks_are_written_from_the_pool_over_nixl(backend: str) -> None:
    """Blocks of 1 MiB (16 KV heads) are runs long enough for the staged runtime to write
    each round straight out of the context engine's pool over NIXL
    (transceiver/round_source.py): the context daemon gathers nothing and the generation
    daemon still scatters. Over Mooncake, where that measured slower, it gathers. Every
    byte is verified either way."""
    if backend == "MOONCAKE" and importlib.util.find_spec("mooncake") is None:
        pytest.skip("mooncake is not installed (scripts/install.sh)")
    proc = _demo("--requests", "12", "--max-tokens", "1500", "--runtime", "CPP",
                 "--backend", backend, "--kv-heads", "16", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["verified"] == 12 and summary["failed"] == 0, summary
    ctx, gen = summary["staging"]["demo-ctx"], summary["staging"]["demo-gen"]
    rounds = ctx["pool_rounds"] + ctx["gathers"]
    assert rounds > 0 and gen["scatters"] == rounds, summary["staging"]
    assert ctx["pool_rounds"] == (rounds if backend == "NIXL" else 0), summary["staging"]

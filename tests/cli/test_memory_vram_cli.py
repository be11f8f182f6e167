"""`--memory vram` on a host without a usable CUDA device: the reference engine, the demo
and the bench each stop at once, with one line that names why (the device probe's reason),
a non-zero status and no traceback. What they do with a GPU runs only on one
(scripts/gpu-check.sh); here, the refusals, and the settings a vram run would use."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cli_harness import kvxferd

from kvxferd.bench.configs import REGISTRY, VRAM_DEFAULT, BenchConfigError, for_memory
from kvxferd.memory.device import probe
from kvxferd.sim.cluster import LocalCluster

pytestmark = pytest.mark.skipif(
    probe().available, reason="a CUDA device is usable here: the refusals do not apply"
)


def _one_clear_line(stderr: str, prog: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    line = lines[0]
    assert line.startswith(f"{prog}: error: --memory vram needs a usable CUDA device"), line
    assert probe().why in line  # the probe's own reason (here: what to install)
    return line


def test_reference_engine_refuses_vram_before_touching_its_daemon(tmp_path: Path) -> None:
    # A socket nobody listens on: an engine that tried to connect would fail differently.
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "kvxferd.sim.engine", "--role", "context",
         "--socket", str(tmp_path / "nobody.sock"), "--memory", "vram"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode != 0 and run.stdout == ""
    _one_clear_line(run.stderr, "python -m kvxferd.sim.engine")
    assert time.monotonic() - started < 30


def test_demo_refuses_vram_without_starting_daemons() -> None:
    run = kvxferd("demo", "--memory", "vram", "--json", timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    _one_clear_line(run.stderr, "kvxferd demo")
    assert "starting" not in run.stderr


def test_demo_vram_needs_nixl() -> None:
    run = kvxferd("demo", "--memory", "vram", "--backend", "UCX", timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "--memory vram moves device pools through NIXL only" in run.stderr


def test_bench_refuses_vram_before_measuring() -> None:
    run = kvxferd("bench", "--memory", "vram", "--json", "--no-progress", timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    _one_clear_line(run.stderr, "kvxferd bench")


def test_bench_help_names_the_memory_flag() -> None:
    # The GPU check looks for --memory in the help before it runs the bench with it.
    run = kvxferd("bench", "--help", timeout=60)
    assert run.returncode == 0 and "--memory" in run.stdout
    assert all(name in run.stdout for name in VRAM_DEFAULT)


def test_vram_runs_nixl_configurations_that_can_move_device_pools() -> None:
    by_name = {c.name: c for c in REGISTRY}
    assert for_memory([by_name[n] for n in VRAM_DEFAULT], "vram")
    for name, why in (
        ("nixl-python", "no bounce buffer"),
        ("nixl-python-tls", "no bounce buffer"),
        ("nixl-python-pipelined", "no bounce buffer"),
        ("ucx-cpp", "host memory only"),
        ("mpi-cpp", "host memory only"),
        ("mooncake-cpp", "host memory only"),
    ):
        with pytest.raises(BenchConfigError, match=why):
            for_memory([by_name[name]], "vram")
    assert for_memory(list(REGISTRY), "host") == list(REGISTRY)  # host: every one, as before


def test_a_vram_cluster_configures_its_daemons_and_engines(tmp_path: Path) -> None:
    host = LocalCluster(tmp_path / "host")
    path, _ = host.write_config("d", "context")
    assert "kv_memory" not in yaml.safe_load(path.read_text())["engine"]
    assert "--memory" not in host.engine_command(_fake(host), "context")

    gpu = LocalCluster(tmp_path / "gpu", kv_memory="vram", vram_share="vmm")
    path, _ = gpu.write_config("d", "context")
    assert yaml.safe_load(path.read_text())["engine"]["kv_memory"] == "vram"
    cmd = gpu.engine_command(_fake(gpu), "context")
    assert cmd[cmd.index("--memory") + 1] == "vram"
    assert cmd[cmd.index("--vram-share") + 1] == "vmm"


def _fake(cluster: LocalCluster) -> object:
    class D:
        api_socket = str(cluster.workdir / "d.sock")

    return D()


def test_the_bench_table_says_when_pools_were_in_vram() -> None:
    from kvxferd.bench.report import header_lines

    report = {
        "mode": "sweep", "date": "d", "block_order": "shuffled", "requests": 1, "warmup": 0,
        "in_flight": 1, "memory": "vram",
        "geometry": {"layers": 1, "kv_heads": 1, "head_dim": 1, "tokens_per_block": 1,
                     "dtype": "float16", "layout": "block-major", "block_bytes": 4},
        "host": {"cpu_count": 1, "cpu_model": "", "python": "3", "nixl_version": "1",
                 "gpu": {"name": "NVIDIA H200", "cupy_version": "14.2.0",
                         "cuda_runtime": 13000, "cuda_driver": 13000}},
    }  # fmt: skip
    assert any("vram on NVIDIA H200" in line for line in header_lines(report))
    report["memory"] = "host"
    assert not any("vram" in line for line in header_lines(report))

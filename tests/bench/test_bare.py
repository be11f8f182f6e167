"""The bare transport pairs of the staged runtime (kvxferd.bench.bare), each run for real
in a tiny geometry, and the CPU accounting the bench reports. No timing is asserted: only
that every round arrived whole and verified, and that the numbers agree with each other."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvxferd.bench import bare_run, cpu
from kvxferd.bench.bare import staged_rounds
from kvxferd.bench.children import BenchError
from kvxferd.bench.configs import from_flags, resolve
from kvxferd.bench.plan import Geometry, Plan
from kvxferd.bench.progress import Progress
from kvxferd.transceiver.staging import blocks_per_round, staging_bytes

TINY = Geometry(layers=2, kv_heads=2, head_dim=16, tokens_per_block=32)
# 2 layers x 2 (K, V) x 32 tokens x 2 heads x 16 x 2 bytes
BLOCK_BYTES = 8192
#: Staging for 4 blocks: a 1000-token request (32 blocks) moves in several rounds.
STAGING_TOKENS = 128

PACKAGES = {"NIXL": "nixl_cu12", "UCX": "ucxx", "MPI": "mpi4py", "MOONCAKE": "mooncake"}


def test_rounds_are_cut_as_the_daemons_cut_them() -> None:
    region = staging_bytes(STAGING_TOKENS, 32, BLOCK_BYTES)
    assert blocks_per_round(region, 32, [BLOCK_BYTES]) == 4
    # Two-sided: the whole region per round; one-sided: at most half of it.
    assert staged_rounds(TINY, 32, False, STAGING_TOKENS) == [4] * 8
    assert staged_rounds(TINY, 33, True, STAGING_TOKENS) == [2] * 16 + [1]
    assert staged_rounds(TINY, 3, False, STAGING_TOKENS) == [3]
    # The bench's own staging (8192 tokens): one round, or two halves one-sided.
    g = Geometry()
    assert staged_rounds(g, 250, False) == [250]
    assert staged_rounds(g, 250, True) == [128, 122]


def test_each_configuration_names_its_own_bare_transport() -> None:
    expect = {"nixl-python": None, "nixl-python-bounce": None, "nixl-cpp": "nixl-rounds",
              "ucx-cpp": "ucx-rounds", "mpi-cpp": "mpi-rounds",
              "mooncake-cpp": "mooncake-rounds"}  # fmt: skip
    for config in resolve(list(expect)):
        spec = bare_run.bare_for(config)
        assert (spec.name if spec else None) == expect[config.name]
    # `auto` over NIXL with a finite timeout is the PYTHON runtime: the raw pair.
    assert bare_run.bare_for(from_flags("DEFAULT", "auto")) is None
    assert bare_run.bare_for(from_flags("NIXL", "CPP")) == bare_run.STAGED["NIXL"]


def _run(transport: str, tmp: Path, lengths: list[int], requests: int) -> dict[str, object]:
    plan = Plan.build(
        mode="sweep", geometry=TINY, lengths=lengths, requests=requests, warmup=1,
        in_flight=1, seconds=1.0, run_id="t",
    )  # fmt: skip
    plan_path = tmp / "plan.json"
    plan.save(plan_path)
    return bare_run.run_pair(
        bare_run.STAGED[transport],
        STAGING_TOKENS,
        plan_path,
        tmp,
        Progress(10, enabled=False),
        120.0,
    )


@pytest.fixture
def short_tmp() -> object:
    # Unix socket paths must stay short; pytest's tmp_path may not be.
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="kvbare-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["NIXL", "UCX", "MPI", "MOONCAKE"])
def test_a_bare_pair_moves_and_verifies_every_round(transport: str, short_tmp: Path) -> None:
    if importlib.util.find_spec(PACKAGES[transport]) is None:
        pytest.skip(f"{PACKAGES[transport]} is not installed")
    report = _run(transport, short_tmp, [40, 1000], 2)
    assert report["error"] == "", report.get("traceback")
    spec = bare_run.STAGED[transport]
    per_request = {40: staged_rounds(TINY, 2, spec.one_sided, STAGING_TOKENS),
                   1000: staged_rounds(TINY, 32, spec.one_sided, STAGING_TOKENS)}  # fmt: skip
    # 1 warm-up + 2 timed requests per length, every round verified by the receiver.
    assert report["verified"] == sum(3 * len(r) for r in per_request.values())
    for tokens, rounds in per_request.items():
        res = bare_run.result_of(report, TINY, tokens, 2, spec.name)
        assert res.rounds == rounds
        assert res.timing.count == 2
        assert res.timing.nbytes == 2 * TINY.request_bytes(tokens)
        assert res.timing.gbps > 0 and res.timing.p50_ms > 0
        assert res.cpu_s is not None and res.cpu_s >= 0
    records = report["records"]
    assert isinstance(records, list)
    assert all(r["t_done_ns"] > r["t_start_ns"] > 0 for r in records)


@pytest.mark.timeout(60)
def test_a_wrong_byte_fails_the_bare_pair(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxferd.bench.bare import CORRUPT_ENV

    monkeypatch.setenv(CORRUPT_ENV, "1")  # inherited by the sender
    with pytest.raises(BenchError, match="round 0: verification failed: logical block 0"):
        _run("NIXL", short_tmp, [40], 1)


def test_cpu_seconds_of_a_real_process() -> None:
    # The child spends 0.3 s of its own CPU time, says so, and waits: what /proc says it
    # spent is at least that (less one clock tick) and at most what it has lived.
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "while time.process_time() < 0.3: pass\n"
         "print(time.process_time(), flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        own = float(child.stdout.readline())
        got = cpu.cpu_seconds(child.pid)
        assert got is not None
        assert own - 0.02 <= got <= own + 1.0
        before = cpu.sample([child.pid, os.getpid()])
        after = cpu.sample([child.pid, os.getpid()])
        spent = cpu.spent(before, after)
        assert spent is not None and spent >= 0
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(10)
    assert cpu.cpu_seconds(child.pid) is None  # reaped: no /proc entry
    assert cpu.spent({"1": 1.0}, {"1": None}) is None
    assert cpu.per_gb(2.0, 4 * 10**9) == pytest.approx(0.5)
    assert cpu.per_gb(None, 10) is None and cpu.per_gb(1.0, 0) is None

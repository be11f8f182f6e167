"""`kvxferd demo --ctx-tp N --gen-tp M`: one daemon per rank, heads split or merged, every
byte of every rank verified; bad sizes are a usage error."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest
from cli_harness import kvxferd
from nixl_harness import nixl_or_skip

nixl_or_skip("the demo needs NIXL (scripts/install.sh)")


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return kvxferd("demo", *args, timeout=300)


def test_demo_merges_two_context_ranks_into_one() -> None:
    proc = _demo(
        "--ctx-tp", "2", "--gen-tp", "1", "--requests", "8", "--max-tokens", "300", "--json"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["requests"] == 8
    assert summary["verified"] == 8 and summary["failed"] == 0, summary
    assert (summary["ctx_tp"], summary["gen_tp"], summary["kv_heads"]) == (2, 1, 4)
    assert summary["daemon_exit_codes"] == {"demo-ctx0": 0, "demo-ctx1": 0, "demo-gen": 0}


def test_demo_splits_one_context_rank_into_two_table() -> None:
    proc = _demo("--ctx-tp", "1", "--gen-tp", "2", "--requests", "6", "--max-tokens", "200")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verified   6" in proc.stdout, proc.stdout
    assert "context TP 1 -> generation TP 2 (4 KV heads)" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    ("ctx_tp", "gen_tp", "backend"), [(2, 1, "NIXL"), (2, 1, "UCX"), (3, 2, "NIXL")]
)
def test_demo_splits_and_merges_under_the_staged_runtime(
    ctx_tp: int, gen_tp: int, backend: str
) -> None:
    """Requests of up to 300 tokens through 64-token staging buffers: several rounds per
    leg, every byte verified. 3 -> 2 (12 heads): each generation rank merges two context
    ranks, one of which it shares with the other generation rank (a split there)."""
    # find_spec, never an import here: see tests/conftest.py.
    if backend == "UCX" and importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed (scripts/install.sh)")
    proc = _demo(
        *("--ctx-tp", str(ctx_tp), "--gen-tp", str(gen_tp), "--runtime", "CPP"),
        *("--backend", backend, "--max-tokens-in-buffer", "64"),
        *("--requests", "8", "--max-tokens", "300", "--json"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["verified"] == 8 and summary["failed"] == 0, summary
    assert (summary["ctx_tp"], summary["gen_tp"]) == (ctx_tp, gen_tp)
    assert set(summary["daemon_exit_codes"].values()) == {0}, summary["daemon_exit_codes"]
    assert len(summary["daemon_exit_codes"]) == ctx_tp + gen_tp


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ctx-tp", "5"], "--ctx-tp must be 1 to 4, got 5"),
        (["--gen-tp", "0"], "--gen-tp must be 1 to 4, got 0"),
        (
            ["--ctx-tp", "3", "--kv-heads", "4"],
            "--kv-heads 4 cannot be split over --ctx-tp 3 ranks",
        ),
    ],
)
def test_demo_refuses_sizes_that_do_not_divide_the_heads(args: list[str], message: str) -> None:
    proc = _demo(*args, "--requests", "1")
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("ctx_tp", "gen_tp", "bounce_mb", "waiter"),
    [(1, 2, "8", "demo-ctx"), (2, 1, "16", "demo-gen")],
)
def test_a_leg_of_a_split_or_merge_waits_for_bounce_room_instead_of_falling_back(
    ctx_tp: int, gen_tp: int, bounce_mb: str, waiter: str
) -> None:
    """PYTHON runtime, 2048-token requests (16 MiB, a leg 8 MiB), 4 in flight, and bounce
    regions that hold one request's legs: the legs queue for room. Falling back instead
    moved a head slice as one descriptor per (block, layer, K/V, token), at ~1/4 of the
    speed, with every daemon core busy (docs/benchmarks.md, "a leg waits for bounce room")."""
    proc = _demo(
        *("--runtime", "PYTHON", "--ctx-tp", str(ctx_tp), "--gen-tp", str(gen_tp)),
        *("--requests", "12", "--in-flight", "4", "--bounce-mb", bounce_mb),
        *("--min-tokens", "2048", "--max-tokens", "2048", "--json"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["verified"] == 12 and summary["failed"] == 0, summary
    # No leg gave up on the bounce region for lack of room, and every leg went through it
    # (before the wait 5 and 6 of 24 did; a merge's receive posted before a context rank
    # announced its pools went per block until it waited for them, Receiver._await_sources).
    assert all(b["fallbacks"] == 0 for b in summary["bounce"].values()), summary["bounce"]
    bounce = summary["bounce"][waiter]
    moved = bounce["one_sided_legs" if ctx_tp < gen_tp else "scatters"]
    assert moved == 24, bounce
    if ctx_tp < gen_tp:
        # The split's sender writes into the ranks' blocks, which lie in few runs: the
        # ranks hold no receive room for it.
        for rank in range(gen_tp):
            assert summary["bounce"][f"demo-gen{rank}"]["reservations_made"] == 0, summary

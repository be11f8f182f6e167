"""The bench's children: a failure names the child that failed AND what became of its
partners, whose log often says why (an MPI peer that gave up mid-connect, say)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvxferd.bench.children import BenchError, spawn, wait_all
from kvxferd.bench.progress import Progress


def test_a_failed_child_is_reported_with_its_partners_logs(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    os.close(write_fd)  # no progress bytes: the children report nothing but their exit
    try:
        crashed = spawn(
            tmp_path,
            "sender",
            ["-c", "import sys; print('sender log', file=sys.stderr); sys.exit(3)"],
        )
        partner = spawn(
            tmp_path,
            "receiver",
            ["-c", "import sys; print('receiver gave up at accept', file=sys.stderr)"],
        )
        with pytest.raises(BenchError) as caught:
            wait_all([crashed, partner], read_fd, Progress(1, enabled=False), 60)
    finally:
        os.close(read_fd)
    text = str(caught.value)
    assert text.startswith("sender exited with status 3:\nsender log")
    assert "--- receiver: exited with status 0\nreceiver gave up at accept" in text


def test_a_partner_not_waited_for_is_reported_too(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    os.close(write_fd)
    receiver = spawn(
        tmp_path,
        "receiver",
        ["-c", "import sys, time; print('accepting', file=sys.stderr, flush=True); time.sleep(60)"],
    )
    try:
        deadline = time.monotonic() + 60
        while "accepting" not in receiver.stderr_tail():  # its log is there to be shown
            assert time.monotonic() < deadline, "the receiver never started"
            time.sleep(0.01)
        sender = spawn(tmp_path, "sender", ["-c", "import sys; sys.exit(2)"])
        with pytest.raises(BenchError) as caught:
            wait_all([sender], read_fd, Progress(1, enabled=False), 60, partners=[receiver])
    finally:
        os.close(read_fd)
        receiver.proc.kill()
        receiver.proc.wait(10)
    assert "--- receiver: still running\naccepting" in str(caught.value)


def test_children_that_all_succeed_raise_nothing(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    os.close(write_fd)
    try:
        kids = [spawn(tmp_path, f"c{i}", ["-c", "pass"]) for i in range(2)]
        wait_all(kids, read_fd, Progress(1, enabled=False), 60)
    finally:
        os.close(read_fd)
    assert [k.proc.returncode for k in kids] == [0, 0]

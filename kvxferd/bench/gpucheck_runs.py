"""The GPU check's processes: one probe (or `kvxferd bench`) run under its cap.

Each runs in a session of its own from the repository's root, its stdout and stderr in the
check's log folder; at its cap (or when the driver stops) the whole session is killed, the
probe's helper processes too. Its `@@gpucheck` lines are merged into the Run's result, so a
probe killed at its cap still gives what it measured before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxferd.bench.probe_io import RESULT

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    """One finished (or killed) process of a step."""

    argv: list[str]
    rc: int | None
    seconds: float
    timed_out: bool
    stdout: str
    stderr_tail: str
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        """It exited other than 0, or was killed at its cap."""
        return self.rc != 0 or self.timed_out

    @property
    def broken(self) -> bool:
        """It failed, or reported an error (a probe that catches its own)."""
        return self.failed or bool(self.result.get("error"))

    def why(self) -> str:
        """What went wrong, in one line, for the JSON."""
        head = f"timed out after {self.seconds:.0f} s" if self.timed_out else f"exited {self.rc}"
        err = self.result.get("error")
        tail = [line for line in self.stderr_tail.strip().splitlines() if line.strip()]
        detail = err or (tail[-1] if tail else "")
        return f"{head}: {detail}"[:600] if detail else head


def _merge_results(stdout: str) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for line in stdout.splitlines():
        if line.startswith(RESULT):
            try:
                merged.update(json.loads(line[len(RESULT) :]))
            except json.JSONDecodeError:
                continue
    return merged


def run_process(argv: list[str], cap_s: float, logdir: Path, tag: str) -> Run:
    """Run argv in a session of its own with its output in logdir; kill the whole session
    (its helper processes too) at the cap."""
    out_path, err_path = logdir / f"{tag}.out", logdir / f"{tag}.err"
    t0 = time.monotonic()
    timed_out = False
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=max(1.0, cap_s))
            # A helper the probe left behind (it crashed past its cleanup) would hold its GPU
            # memory on, outside the outer timeout's reach: the session goes with its leader.
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_session(proc)
            rc = proc.returncode
        except BaseException:
            # The probes run in sessions of their own, which a kill of ours would not reach.
            _kill_session(proc)
            raise
    seconds = time.monotonic() - t0
    stdout = out_path.read_text(errors="replace")
    stderr = err_path.read_text(errors="replace")
    run = Run(argv, rc, seconds, timed_out, stdout, stderr[-4000:])
    run.result = _merge_results(stdout)
    return run


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            # The leader is gone; its helpers may linger in the session: one more kill.
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
        return


def probe_argv(python: str, role: str, *args: str) -> list[str]:
    return [python, "-m", "kvxferd.bench.gpu_probes", role, *args]

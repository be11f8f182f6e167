"""The bench's child processes: started with their output in files, waited for with their
progress relayed, and their one-line JSON report read back.

Every measurement of `kvxferd bench` (bench engines, the raw NIXL pair, the bare transport
pairs) runs in processes of its own, started and joined here.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvxferd.bench.progress import Progress
from kvxferd.errors import KvxferdError
from kvxferd.service.listeners import pin_ucx_devices

#: How long a child's partner gets to finish after it exited, before it is killed.
_GRACE_S = 15.0


class BenchError(KvxferdError):
    """The benchmark could not run or a request failed (exit status 1)."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    out_path: Path
    err_path: Path
    killed: bool = False

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            return self.err_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def report(self) -> dict[str, Any]:
        if self.killed:
            raise BenchError(
                f"{self.name} did not finish within {_GRACE_S:.0f} s of its partner and was "
                f"stopped:\n{self.stderr_tail()}"
            )
        text = self.out_path.read_text(errors="replace").strip()
        try:
            report: dict[str, Any] = json.loads(text.splitlines()[-1]) if text else {}
        except json.JSONDecodeError as exc:
            raise BenchError(
                f"{self.name} printed no report ({exc}):\n{text[-1000:]}\n{self.stderr_tail()}"
            ) from exc
        if not report:
            raise BenchError(f"{self.name} printed no report:\n{self.stderr_tail()}")
        return report

    def wait_for_file(self, path: Path, what: str, timeout_s: float = 120.0) -> None:
        """Wait for the file this child writes once it is ready (its connection info);
        BenchError naming `what` if it exits or takes longer than `timeout_s` first."""
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if self.proc.poll() is not None:
                raise BenchError(
                    f"{what} exited with {self.proc.returncode}:\n" + self.stderr_tail()
                )
            if time.monotonic() > deadline:
                raise BenchError(f"{what} did not start within {timeout_s:.0f} s")
            time.sleep(0.02)

    def reap(self, wait_s: float = 30.0) -> None:
        """Wait for a child that ends on its own once its partner is done; kill it if it
        does not within `wait_s`."""
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def spawn(
    workdir: Path,
    name: str,
    argv: list[str],
    pass_fds: Sequence[int] = (),
    stdin: int | None = subprocess.DEVNULL,
) -> Child:
    out_path, err_path = workdir / f"{name}.out", workdir / f"{name}.err"
    # Every pair the bench runs is on loopback: UCX (NIXL's, ucxx's, MPICH's) stays on
    # `lo` as the daemons' does (service/listeners.py). Besides measuring both with the
    # same UCX set-up, that keeps the children clear of devices that come and go on the
    # host (pods' veths): UCX enumerating one as it vanishes failed MPI_Init and NIXL's
    # createBackend with "Destination is unreachable".
    env = dict(os.environ)
    pin_ucx_devices("127.0.0.1", env)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            stdout=out,
            stderr=err,
            stdin=stdin,
            pass_fds=tuple(pass_fds),
            env=env,
        )
    return Child(name, proc, out_path, err_path)


def run_reporting(
    workdir: Path,
    name: str,
    argv: list[str],
    prog: Progress,
    timeout_s: float,
    partners: Sequence[Child] = (),
) -> Child:
    """Spawn the child that reports a run (`argv` gets `--progress-fd`), relay its progress
    until it exits (wait_all, with `partners`), and return it for its report. The pipe's
    write end is ours only until the child has it: its end of file then says the child is
    gone."""
    prog_r, prog_w = os.pipe()
    try:
        child = spawn(workdir, name, [*argv, "--progress-fd", str(prog_w)], pass_fds=(prog_w,))
        os.close(prog_w)
        prog_w = -1
        wait_all([child], prog_r, prog, timeout_s, partners=partners)
    finally:
        os.close(prog_r)
        if prog_w >= 0:
            os.close(prog_w)
    return child


def wait_all(
    children: list[Child],
    progress_fd: int,
    prog: Progress,
    timeout_s: float,
    partners: Sequence[Child] = (),
) -> None:
    """Wait for every child, relaying the progress bytes. Once one has exited, the others get
    _GRACE_S to follow (partners finish within milliseconds of each other), then are killed.
    Raises for a child that failed by itself, with the logs of the others and of
    `partners` (children not waited for here, such as a pair's receiver); the caller reads
    the reports of the rest."""
    deadline = time.monotonic() + timeout_s
    fd_open = True
    first_exit: float | None = None
    try:
        while True:
            if fd_open:
                ready, _, _ = select.select([progress_fd], [], [], 0.1)
                if ready:
                    data = os.read(progress_fd, 65536)
                    if data:
                        prog.advance(len(data))
                    else:
                        fd_open = False
            else:
                time.sleep(0.05)
            prog.tick()
            codes = [c.proc.poll() for c in children]
            if all(code is not None for code in codes):
                break
            now = time.monotonic()
            if first_exit is None and any(code is not None for code in codes):
                first_exit = now
            if first_exit is not None and now - first_exit > _GRACE_S:
                break
            if now > deadline:
                running = [c.name for c in children if c.proc.poll() is None]
                raise BenchError(f"{', '.join(running)} still running after {timeout_s:.0f} s")
    finally:
        for c in children:
            if c.proc.poll() is None:
                c.killed = True
                c.proc.kill()
                c.proc.wait(10)
    failed = [c for c in children if c.proc.returncode != 0 and not c.killed]
    if failed:
        # The partners' fate too: a crash in one is often the other's doing (an MPI
        # peer that gave up mid-connect, say), and its log says so.
        others = "".join(
            f"\n--- {c.name}: {_fate(c)}\n{c.stderr_tail(1500)}"
            for c in [*children, *partners]
            if c is not failed[0]
        )
        first = failed[0]
        raise BenchError(
            f"{first.name} exited with status {first.proc.returncode}:\n"
            f"{first.stderr_tail()}{others}"
        )


def _fate(c: Child) -> str:
    if c.killed:
        return f"stopped after {_GRACE_S:.0f} s of grace"
    code = c.proc.poll()
    return "still running" if code is None else f"exited with status {code}"


def check_report(what: str, report: dict[str, Any], logs: str = "") -> None:
    """Raise BenchError when a child's report says it failed (with its traceback, if any)."""
    if report.get("error"):
        detail = report.get("traceback", "")  # only when an exception ended the process
        raise BenchError(f"{what}: {report['error']}" + (f"\n{detail}" if detail else "") + logs)

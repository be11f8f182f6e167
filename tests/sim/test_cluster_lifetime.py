"""Daemons started by LocalCluster die with the process that started them: a test run
or a demo that is killed (a CI timeout, SIGKILL) leaves no daemon behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nixl_harness import nixl_or_skip

nixl_or_skip("a daemon needs NIXL (scripts/install.sh)")

_STARTER = """
import sys, time
from pathlib import Path
from kvxferd.sim.cluster import LocalCluster
c = LocalCluster(Path(sys.argv[1]))
d = c.start_daemon("orphan", "context")
print(d.proc.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie waiting for its (now init) parent to reap it counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_a_daemon_dies_with_the_killed_process_that_started_it(tmp_path: Path) -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert starter.stdout is not None
        line = starter.stdout.readline()
        assert line.strip().isdigit(), (line, starter.stderr.read() if starter.stderr else "")
        pid = int(line)
        assert not _gone(pid), "the daemon should be running while its starter lives"
        starter.send_signal(signal.SIGKILL)  # no cleanup code of the starter runs
        starter.wait(10)
        deadline = time.monotonic() + 20
        while not _gone(pid):
            assert time.monotonic() < deadline, f"daemon {pid} outlived the killed starter"
            time.sleep(0.05)
    finally:
        if starter.poll() is None:
            starter.kill()

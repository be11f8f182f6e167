"""Whether an announced process is gone (kvxferd.peers.process): what counts as proof.

A receiver hands blocks back, and the vLLM connector reports a transfer, on "gone" only:
a stopped process is alive, a reaped or zombie one is gone, and a /proc it cannot read
(mounted hidepid, another uid) proves nothing, either way. Real processes; an unreadable
/proc is the one fault faked (the test runs as root, whom hidepid does not hide from).
"""

from __future__ import annotations

import errno
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from kvxferd.peers import process
from kvxferd.peers.process import ProcessInfo, alive, exited, me


def _info(pid: int) -> ProcessInfo:
    fields = process._stat_fields(pid)
    assert fields is not None
    return ProcessInfo(boot_id=me().boot_id, pid_ns=me().pid_ns, pid=pid, start=int(fields[19]))


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def test_a_stopped_process_is_alive_and_a_killed_one_gone_reaped_or_not(
    child: subprocess.Popen[bytes],
) -> None:
    info = _info(child.pid)
    assert alive(info) is True
    child.send_signal(signal.SIGSTOP)
    assert alive(info) is True and not exited(info)
    child.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(info) is not False:  # a zombie, then reaped: gone either way
        assert time.monotonic() < deadline, "the killed child never read as gone"
        time.sleep(0.01)
    assert exited(info)
    child.wait()
    assert alive(info) is False


def test_another_process_under_the_number_means_the_announced_one_is_gone(
    child: subprocess.Popen[bytes],
) -> None:
    info = _info(child.pid)
    reused = ProcessInfo(info.boot_id, info.pid_ns, info.pid, info.start + 1)
    assert alive(reused) is False


@pytest.mark.parametrize("err", [errno.EACCES, errno.ENOENT])
def test_a_proc_it_cannot_read_proves_nothing_about_a_live_process(
    child: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    """hidepid=1 answers EACCES, hidepid=2 ENOENT (the entry is hidden): while the pidfd
    says the process runs, neither may read as gone (it once did, and a live writer's
    blocks would have been handed back)."""
    info = _info(child.pid)

    def unreadable(path: str) -> str:
        raise OSError(err, "hidden", path)

    monkeypatch.setattr(process, "_read", unreadable)
    assert alive(info) is None and not exited(info)
    child.kill()
    child.wait()
    assert alive(info) is False  # no pidfd can be opened for it any more


def test_a_process_of_another_namespace_proves_nothing() -> None:
    other = ProcessInfo(boot_id="another-kernel", pid_ns=me().pid_ns, pid=1, start=1)
    assert alive(other) is None and not exited(other)

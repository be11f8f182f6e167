"""`kvxferd run` restarts itself once with glibc's non-temporal threshold set
(service/copy_tuning.py): what it decides, that glibc takes the value, and that a real
daemon runs with it, in the process it was started as, unless the operator chose."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
from pathlib import Path

import pytest

from kvxferd.service import copy_tuning
from kvxferd.service.copy_tuning import (
    NT_TUNABLE,
    REEXEC_MARK_ENV,
    TUNABLES_ENV,
    nt_copies_env,
)
from kvxferd.sim.cluster import LocalCluster

OURS = f"{NT_TUNABLE}=0x100000"
X86_GLIBC = platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


def test_the_threshold_is_added_to_what_the_environment_has() -> None:
    env = nt_copies_env({"PATH": "/bin"}, "x86_64", "glibc")
    assert env is not None
    assert env[TUNABLES_ENV] == OURS and env["PATH"] == "/bin"
    assert env[REEXEC_MARK_ENV] == OURS
    other = "glibc.malloc.arena_max=2"
    env = nt_copies_env({TUNABLES_ENV: other}, "AMD64", "glibc")
    assert env is not None and env[TUNABLES_ENV] == f"{other}:{OURS}"


@pytest.mark.parametrize(
    "environ, machine, libc",
    [
        ({TUNABLES_ENV: f"{NT_TUNABLE}=0xf000000"}, "x86_64", "glibc"),  # the operator's
        ({REEXEC_MARK_ENV: OURS}, "x86_64", "glibc"),  # already restarted (glibc dropped it)
        ({}, "aarch64", "glibc"),  # no such tunable there
        ({}, "x86_64", ""),  # not glibc (musl)
    ],
)
def test_no_restart_when_not_wanted(environ: dict[str, str], machine: str, libc: str) -> None:
    assert nt_copies_env(environ, machine, libc) is None


@pytest.mark.skipif(not X86_GLIBC, reason="glibc's x86 tunable")
def test_glibc_takes_the_value() -> None:
    # A misspelt tunable is ignored without a word: ask this glibc what it made of it.
    env = nt_copies_env({}, "x86_64", "glibc")
    assert env is not None
    loader = Path("/lib64/ld-linux-x86-64.so.2")
    if not loader.exists():
        pytest.skip("no x86-64 glibc loader at the usual path")
    out = subprocess.run(
        [str(loader), "--list-tunables"], env=env, capture_output=True, text=True, timeout=30
    )
    if out.returncode != 0:
        pytest.skip(f"this glibc lists no tunables: {out.stderr.strip()}")
    line = next(x for x in out.stdout.splitlines() if x.startswith(NT_TUNABLE + ":"))
    assert line.split()[1] == "0x100000", line


def test_a_failed_exec_leaves_the_process_running_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*_: object) -> None:
        raise PermissionError("exec refused")

    monkeypatch.setattr(copy_tuning, "nt_copies_env", lambda *_: {"X": "1"})
    monkeypatch.setattr(os, "execve", refuse)
    with caplog.at_level(logging.WARNING, logger="kvxferd.daemon"):
        copy_tuning.reexec_with_nt_copies()
    assert "exec refused" in caplog.text and NT_TUNABLE in caplog.text


@pytest.mark.skipif(not X86_GLIBC, reason="glibc's x86 tunable")
def test_a_daemon_runs_with_the_threshold_in_the_process_it_was_started_as(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (TUNABLES_ENV, REEXEC_MARK_ENV):
        monkeypatch.delenv(name, raising=False)
    d = cluster.start_daemon("ctx", "context")  # ready: it answered on its API socket
    env = _environ(d.proc.pid)  # the pid its starter holds: exec kept it
    assert env[TUNABLES_ENV] == OURS
    assert f"large copies use non-temporal stores: GLIBC_TUNABLES {OURS}" in d.log_text()
    assert d.stop() == 0


@pytest.mark.skipif(not X86_GLIBC, reason="glibc's x86 tunable")
def test_the_operators_own_threshold_stands(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs = f"glibc.malloc.arena_max=2:{NT_TUNABLE}=0x400000"
    monkeypatch.setenv(TUNABLES_ENV, theirs)
    monkeypatch.delenv(REEXEC_MARK_ENV, raising=False)
    d = cluster.start_daemon("ctx", "context")
    # Not restarted (glibc cuts the variable at its first ':' in /proc/PID/environ, as it
    # parses it in place, so the variable itself is not compared).
    assert REEXEC_MARK_ENV not in _environ(d.proc.pid)
    assert "non-temporal" not in d.log_text()
    assert d.stop() == 0

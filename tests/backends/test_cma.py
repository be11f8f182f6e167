"""Whether a write to a peer on this kernel may go by UCX's CMA (kvxferd/backends/cma.py):
what decides between cancelling an in-flight write at once and draining it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvxferd.backends import cma


@pytest.mark.parametrize(
    ("tls", "allowed"),
    [
        (None, True),
        ("", True),
        ("  ", True),
        ("all", True),
        ("cma", True),
        ("tcp,cma", True),
        ("sm", True),
        ("shm,tcp", True),
        ("^mm", True),  # posix and sysv out, CMA kept
        ("^tcp", True),
        ("tcp", False),
        ("tcp,self", False),
        ("posix,sysv,self", False),
        ("^cma", False),
        ("^sm", False),
        ("^shm,tcp", False),
        ("^tcp,CMA", False),
        ("tcp:aux,posix", False),
        ("cma:aux,tcp", False),  # aux: wire-up only, not the data
        ("sm:aux,tcp", False),
    ],
)
def test_ucx_tls_decides_whether_cma_may_carry_writes(tls: str | None, allowed: bool) -> None:
    assert cma.tls_allows_cma(tls) is allowed


@pytest.mark.parametrize(
    ("scope", "allowed"), [("0\n", True), ("1\n", True), ("2", False), ("3", False)]
)
def test_yamas_ptrace_scope_above_1_counts_as_no_cma(
    tmp_path: Path, scope: str, allowed: bool
) -> None:
    # 1: UCX declares any process its ptracer. 2: UCX decides by a capability test that
    # differs between its versions and builds: taken as no (only a drain is lost).
    path = tmp_path / "ptrace_scope"
    path.write_text(scope)
    assert cma.ptrace_allows_cma(str(path)) is allowed


def test_without_yama_cma_is_allowed_and_an_unreadable_scope_is_not(tmp_path: Path) -> None:
    assert cma.ptrace_allows_cma(str(tmp_path / "absent")) is True
    assert cma.ptrace_allows_cma(str(tmp_path)) is False  # a directory: unreadable, say no


def test_process_vm_writev_works_on_this_host() -> None:
    # Real, not faked: the daemons' tests on this host write with CMA.
    assert cma.writev_works() is True


def test_only_ucx_backends_may_write_with_cma(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cma, "ptrace_allows_cma", lambda: True)
    monkeypatch.setattr(cma, "writev_works", lambda: True)
    keeps = {"TLS": "^tcp", "SHM_DEVICES": "all", "MODULES": "all"}
    assert cma.cma_writes("NIXL", lambda b: [keeps]) is True
    assert cma.cma_writes("UCX", lambda b: [keeps]) is True
    assert cma.cma_writes("NIXL", lambda b: [{**keeps, "TLS": "tcp"}]) is False
    assert cma.cma_writes("MOONCAKE", lambda b: [keeps]) is False  # its own TCP
    assert cma.cma_writes("MPI", lambda b: [keeps]) is False  # two-sided; no one-sided writes
    monkeypatch.setattr(cma, "ptrace_allows_cma", lambda: False)
    assert cma.cma_writes("NIXL", lambda b: [keeps]) is False
    monkeypatch.setattr(cma, "ptrace_allows_cma", lambda: True)
    monkeypatch.setattr(cma, "writev_works", lambda: False)  # seccomp refusing it
    assert cma.cma_writes("NIXL", lambda b: [keeps]) is False

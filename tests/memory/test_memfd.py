"""MemfdRegion and check_memfd: seals, refusal of fds that could shrink, fd passing between
processes, no fd leaks."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fd_harness import fd_table

import kvxferd
from kvxferd.memory import MemfdError, MemfdRegion, ShmRegion, UnsealedMemfdError
from kvxferd.memory.memfd import ENGINE_SEALS, check_memfd

REPO_ROOT = Path(kvxferd.__file__).resolve().parent.parent
NBYTES = 3 * 4096 + 5


@pytest.fixture
def fds_unchanged() -> Iterator[None]:
    """The test leaves no fd open that it opened."""
    before = fd_table()
    yield
    assert fd_table() <= before


def test_create_seals_against_shrinking_and_growing(fds_unchanged: None) -> None:
    with MemfdRegion.create(NBYTES, "test-pool") as region:
        fd = region.fd
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == ENGINE_SEALS
        assert os.fstat(fd).st_size == NBYTES == region.nbytes
        assert region.array.shape == (NBYTES,) and not region.array.any()
        region.array[:] = 7
        for size in (0, NBYTES - 1, NBYTES + 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        # Another open file description of the same memfd is bound by the same seals.
        with pytest.raises(PermissionError):
            os.truncate(f"/proc/self/fd/{fd}", 0)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # F_SEAL_SEAL: no more seals
        assert check_memfd(fd, NBYTES) == ENGINE_SEALS
        assert int(region.array[NBYTES - 1]) == 7
    assert region.closed
    region.close()  # idempotent
    with pytest.raises(MemfdError, match="closed"):
        _ = region.array
    with pytest.raises(MemfdError, match="no file descriptor"):
        _ = region.fd


def _memfd(flags: int = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING, seals: int = 0) -> int:
    fd = os.memfd_create("test-unsealed", flags)
    os.ftruncate(fd, NBYTES)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("unsealed", "not sealed against shrinking.*missing F_SEAL_SHRINK.*F_ADD_SEALS"),
        ("grow-only", r"seals: F_SEAL_GROW; missing F_SEAL_SHRINK"),
        ("no-sealing", "missing F_SEAL_SHRINK.*can no longer be sealed"),
        ("write-sealed", "write-sealed"),
        ("pipe", r"not a memfd \(pipe:"),
        ("file", "not a memfd.*no seals"),
        ("shm", "missing F_SEAL_SHRINK.*/dev/shm"),
    ],
)
def test_check_refuses_what_could_shrink_or_cannot_be_written(
    kind: str, match: str, tmp_path: Path, fds_unchanged: None
) -> None:
    keep: list[int] = []
    shm: ShmRegion | None = None
    if kind == "unsealed":
        fd = _memfd()
    elif kind == "grow-only":
        fd = _memfd(seals=fcntl.F_SEAL_GROW)
    elif kind == "no-sealing":
        fd = _memfd(flags=os.MFD_CLOEXEC)
    elif kind == "write-sealed":
        fd = _memfd(seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    elif kind == "pipe":
        fd, w = os.pipe()
        keep.append(w)
    elif kind == "file":
        path = tmp_path / "pool"
        path.write_bytes(b"\0" * NBYTES)
        fd = os.open(path, os.O_RDWR)
    else:
        name = f"kvxferd-test-memfd-{os.getpid()}"
        shm = ShmRegion.create(name, NBYTES)
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        shm.unlink()
    try:
        with pytest.raises(UnsealedMemfdError, match=match) as info:
            check_memfd(fd, NBYTES, "pool 'p7'")
        assert str(info.value).startswith("pool 'p7': ")
        with pytest.raises(UnsealedMemfdError):
            MemfdRegion.attach(fd, NBYTES, "pool 'p7'")
        os.fstat(fd)  # a refusal never closes the caller's fd
    finally:
        os.close(fd)
        for k in keep:
            os.close(k)
        if shm is not None:
            shm.close()


def test_check_refuses_a_sealed_memfd_that_is_too_small(fds_unchanged: None) -> None:
    with MemfdRegion.create(4096) as region:
        with pytest.raises(MemfdError, match="has 4096 bytes, 8192 bytes are needed") as info:
            check_memfd(region.fd, 8192, "pool 'small'")
        assert not isinstance(info.value, UnsealedMemfdError)


def test_fd_passed_to_another_process_maps_the_same_sealed_memory(fds_unchanged: None) -> None:
    """The engine (a child process) creates and fills a pool and sends its fd with SCM_RIGHTS;
    this process (the daemon's side) checks and maps it, writes back, and the engine cannot
    shrink it afterwards."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child_code = textwrap.dedent(
        f"""
        import os, socket
        from kvxferd.memory import MemfdRegion
        sock = socket.socket(fileno={theirs.fileno()})
        region = MemfdRegion.create({NBYTES}, "child-pool")
        region.array[:] = 0x5A
        socket.send_fds(sock, [b"p"], [region.fd])
        assert sock.recv(1) == b"w"  # the parent wrote its bytes
        print("seen", int(region.array[0]), int(region.array[-1]))
        try:
            os.ftruncate(region.fd, 4096)
            print("truncated")
        except PermissionError:
            print("truncate refused")
        region.close()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", child_code],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        pass_fds=[theirs.fileno()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    try:
        ours.settimeout(60)
        data, fds, _, _ = socket.recv_fds(ours, 1, 4)
        assert data == b"p" and len(fds) == 1
        try:
            region = MemfdRegion.attach(fds[0], NBYTES, "pool 'child'")
        finally:
            os.close(fds[0])  # the mapping keeps the memory
        with region:
            assert np.all(region.array == 0x5A)
            region.array[0] = 1
            region.array[-1] = 2
            ours.sendall(b"w")
            out, err = child.communicate(timeout=60)
            assert child.returncode == 0, err
            assert out.split("\n")[:2] == ["seen 1 2", "truncate refused"], (out, err)
            assert int(region.array[-1]) == 2  # still mapped, still the full size
    finally:
        ours.close()
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_no_fd_leaks_over_many_regions(fds_unchanged: None) -> None:
    for _ in range(50):
        region = MemfdRegion.create(8192)
        attached = MemfdRegion.attach(region.fd, 8192)
        view = attached.array  # a live view defers the unmap, never the fd's close
        attached.close()
        with pytest.raises(MemfdError):
            MemfdRegion.attach(region.fd, 16384)
        region.close()
        del view

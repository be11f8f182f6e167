"""ShmRegion: create/attach across processes, errors, close/unlink, permissions."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import stat
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvxferd
from kvxferd.errors import KvxferdError
from kvxferd.memory import (
    ShmError,
    ShmExistsError,
    ShmNotFoundError,
    ShmRegion,
    ShmTooSmallError,
)
from kvxferd.memory.shm import SHM_DIR

REPO_ROOT = Path(kvxferd.__file__).resolve().parent.parent


@pytest.fixture
def name() -> Iterator[str]:
    """A fresh region name; whatever a test leaves behind under it is removed."""
    n = f"kvxferd-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    yield n
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, n))


def run_child(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_child_writes_and_parent_reads(name: str) -> None:
    nbytes = 3 * 4096 + 5
    with ShmRegion.create(name, nbytes) as region:
        assert region.array.shape == (nbytes,)
        assert not region.array.any()  # a new region reads as zeros
        result = run_child(
            f"""
            import numpy as np
            from kvxferd.memory import ShmRegion
            with ShmRegion.attach({name!r}, {nbytes}) as r:
                r.array[:] = np.arange({nbytes}, dtype=np.uint64).astype(np.uint8)
                print(r.nbytes)
            """
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == str(nbytes)
        expected = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
        assert np.array_equal(region.array, expected)
        region.unlink()


def test_parent_writes_and_child_reads_a_prefix(name: str) -> None:
    with ShmRegion.create(name, 8192) as region:
        region.array[:16] = np.frombuffer(b"kv-cache-blocks!", dtype=np.uint8)
        result = run_child(
            f"""
            from kvxferd.memory import ShmRegion
            r = ShmRegion.attach({name!r}, 16)  # attaching to less than the whole is fine
            print(bytes(r.array).decode())
            r.close()
            """
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "kv-cache-blocks!"
        region.unlink()


def test_address_is_the_base_of_the_mapping(name: str) -> None:
    with ShmRegion.create(name, 4096) as region:
        region.array[:4] = [1, 2, 3, 4]
        assert region.address == region.array.ctypes.data
        assert ctypes.string_at(region.address, 4) == b"\x01\x02\x03\x04"
        assert region.address % os.sysconf("SC_PAGE_SIZE") == 0
        region.unlink()


def test_region_is_private_to_its_user_even_with_an_open_umask(name: str) -> None:
    old = os.umask(0)
    try:
        region = ShmRegion.create(name, 4096)
    finally:
        os.umask(old)
    try:
        mode = os.stat(os.path.join(SHM_DIR, name)).st_mode
        assert stat.S_IMODE(mode) == 0o600
    finally:
        region.close()
        region.unlink()


def test_attach_to_a_missing_name_says_so(name: str) -> None:
    with pytest.raises(ShmNotFoundError, match=name) as info:
        ShmRegion.attach(name, 4096)
    assert isinstance(info.value, KvxferdError)
    assert "No such file or directory" in str(info.value)


def test_attach_to_a_region_too_small_names_both_sizes(name: str) -> None:
    # The region goes with the test: closed here, unlinked by the `name` fixture.
    with (
        ShmRegion.create(name, 4096),
        pytest.raises(ShmTooSmallError, match="it has 4096 bytes, 8192 bytes are needed"),
    ):
        ShmRegion.attach(name, 8192)


def test_create_refuses_an_existing_name(name: str) -> None:
    # The region goes with the test: closed here, unlinked by the `name` fixture.
    with ShmRegion.create(name, 4096), pytest.raises(ShmExistsError, match="File exists"):
        ShmRegion.create(name, 4096)


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "../etc", "x" * 201, "é", "a b"])
def test_invalid_names_are_refused(bad: str) -> None:
    with pytest.raises(ShmError, match="invalid shared memory name"):
        ShmRegion.create(bad, 4096)
    with pytest.raises(ShmError, match="invalid shared memory name"):
        ShmRegion.attach(bad, 4096)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_invalid_sizes_are_refused(name: str, bad: object) -> None:
    with pytest.raises(ShmError, match="size must be a positive integer"):
        ShmRegion.create(name, bad)  # type: ignore[arg-type]
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_a_region_larger_than_dev_shm_fails_at_create_and_leaves_nothing(name: str) -> None:
    # Without the reservation this would "succeed" and SIGBUS the engine at first touch.
    with pytest.raises(ShmError, match=r"cannot size 1125899906842624 bytes.*df -h /dev/shm"):
        ShmRegion.create(name, 1 << 50)
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_close_and_unlink_are_idempotent(name: str) -> None:
    region = ShmRegion.create(name, 4096)
    region.close()
    region.close()
    assert region.closed
    with pytest.raises(ShmError, match="is closed"):
        _ = region.array
    with pytest.raises(ShmError, match="is closed"):
        _ = region.address
    region.unlink()
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    region.unlink()


def test_unlink_of_a_name_already_gone_is_not_an_error(name: str) -> None:
    region = ShmRegion.create(name, 4096)
    os.unlink(os.path.join(SHM_DIR, name))
    region.unlink()
    region.close()


def test_second_unlink_does_not_remove_a_new_region_of_the_same_name(name: str) -> None:
    first = ShmRegion.create(name, 4096)
    first.unlink()
    second = ShmRegion.create(name, 4096)
    try:
        first.unlink()
        assert os.path.exists(os.path.join(SHM_DIR, name))
    finally:
        first.close()
        second.close()
        second.unlink()


def test_close_with_a_live_view_keeps_the_view_valid(name: str) -> None:
    region = ShmRegion.create(name, 4096)
    view = region.array[10:20]
    view[:] = 7
    region.close()  # must neither raise nor unmap memory the view still points at
    assert region.closed
    assert view.sum() == 70
    del view
    gc.collect()
    region.unlink()


def test_context_manager_closes_but_does_not_unlink(name: str) -> None:
    with ShmRegion.create(name, 4096) as region:
        pass
    assert region.closed
    assert os.path.exists(os.path.join(SHM_DIR, name))
    with ShmRegion.attach(name, 4096) as again:
        assert again.nbytes == 4096
        again.unlink()
    assert not os.path.exists(os.path.join(SHM_DIR, name))

"""UCX_TLS where UCX reads it: the environment, else the ucx.conf files. A limit set only in
a ucx.conf must turn the same-host cancel-at-once rule off (backends/cma.py), or a write
cancelled into a stopped receiver could still land (docs/operations.md, "Drained
writes")."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvxferd.backends import cma, ucx_conf


@pytest.fixture(autouse=True)
def no_system_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The host's /etc/ucx/ucx.conf, if any, stays out of these cases."""
    monkeypatch.setattr(ucx_conf, "SYSTEM_DIR", str(tmp_path / "no-system"))


def _conf(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "ucx.conf"
    path.write_text(text)
    return path


def test_the_environment_wins_over_every_file(tmp_path: Path) -> None:
    _conf(tmp_path, "UCX_TLS=tcp\n")
    env = {"HOME": str(tmp_path), "UCX_TLS": "sm,self"}
    assert ucx_conf.tls_values(env, []) == ["sm,self"]


def test_no_file_is_ucx_default(tmp_path: Path) -> None:
    assert ucx_conf.tls_values({"HOME": str(tmp_path)}, []) == [None]


def test_each_file_ucx_reads_counts(tmp_path: Path) -> None:
    lib = tmp_path / "pkg" / "lib"
    lib.mkdir(parents=True)
    _conf(tmp_path / "pkg" / "etc" / "ucx", "# beside the library\nUCX_TLS = ^cma ; no CMA\n")
    _conf(tmp_path / "home", "[some section]\nUCX_TLS=tcp,self\nUCX_NET_DEVICES=lo\n")
    _conf(tmp_path / "custom", "UCX_TLS=sm\nUCX_TLS=all\n")  # the last one counts
    env = {"HOME": str(tmp_path / "home"), "UCX_CONFIG_DIR": str(tmp_path / "custom")}
    assert ucx_conf.tls_values(env, [lib]) == ["^cma", "tcp,self", "all"]
    assert not any(cma.tls_allows_cma(v) for v in ["^cma", "tcp,self"])


@pytest.mark.parametrize("kind", ["directory", "fifo", "huge"])
def test_a_file_that_cannot_be_read_allows_no_cma(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "ucx.conf"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # a read would block: not read at all
    else:
        path.write_text("UCX_TLS=all\n" + "#" * ucx_conf.MAX_BYTES)
    assert ucx_conf.tls_values({"HOME": str(tmp_path)}, []) == [ucx_conf.UNREADABLE]
    assert not cma.tls_allows_cma(ucx_conf.UNREADABLE)


def test_a_limit_in_a_file_turns_cma_off(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    allowed_without = cma.cma_writes("NIXL", env, [])
    _conf(tmp_path, "UCX_TLS=tcp\n")
    assert not cma.cma_writes("NIXL", env, [])
    _conf(tmp_path, "UCX_TLS=sm,self\n")
    assert cma.cma_writes("NIXL", env, []) == allowed_without


def test_this_process_finds_the_wheels_ucx_libraries() -> None:
    """NIXL's wheel ships its own UCX (nixl_cu12.libs), which reads the ucx.conf beside it."""
    dirs = {d.name for d in ucx_conf.library_dirs()}
    assert "nixl_cu12.libs" in dirs


def test_real_ucx_reads_the_same_file(tmp_path: Path) -> None:
    """The real UCX (ucxx's) takes UCX_TLS from $HOME/ucx.conf, and so does the decision."""
    if importlib.util.find_spec("ucxx") is None:  # not imported here: it sets UCX_* variables
        pytest.skip("ucxx is not installed")
    _conf(tmp_path, "UCX_TLS=tcp\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["HOME"] = str(tmp_path)
    code = (
        "import ucxx; from kvxferd.backends import cma; "
        "print(ucxx.get_config()['TLS'], cma.cma_writes('NIXL'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["tcp", "False"]

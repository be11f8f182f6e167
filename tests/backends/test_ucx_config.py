"""Whether UCX leaves CMA out, asked of the backend's own UCX copy (backends/ucx_config.py).
A limit set where the daemon did not look (a ucx.conf in $HOME or the working directory,
UCX_SHM_DEVICES, UCX_MODULES) must turn the same-host cancel-at-once rule off, or a write
cancelled into a stopped receiver could still land (docs/operations.md, "Drained
writes"). Checked against what NIXL's UCX really does, from its debug log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvxferd.backends import cma, ucx_config

ALL = {"TLS": "all", "SHM_DEVICES": "all", "MODULES": "all"}


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("TLS", "all", True),
        ("TLS", "tcp", False),
        ("TLS", "^cma", False),
        ("TLS", "^all", False),
        ("SHM_DEVICES", "memory", True),
        ("SHM_DEVICES", "none", False),
        ("SHM_DEVICES", "^memory", False),
        ("MODULES", "^cma", False),
        ("MODULES", "^ib,cuda", True),
        ("MODULES", "ib", False),
    ],
)
def test_each_setting_that_leaves_cma_out(field: str, value: str, allowed: bool) -> None:
    assert cma.settings_allow_cma({**ALL, field: value}) is allowed


def test_every_copy_must_keep_cma(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cma, "ptrace_allows_cma", lambda: True)
    monkeypatch.setattr(cma, "writev_works", lambda: True)
    assert cma.cma_writes("NIXL", lambda b: [ALL]) is True
    assert cma.cma_writes("NIXL", lambda b: [ALL, {**ALL, "TLS": "tcp"}]) is False
    assert cma.cma_writes("NIXL", lambda b: [ALL, None]) is False  # one could not say
    assert cma.cma_writes("NIXL", lambda b: []) is False  # no UCX found to ask


def test_the_installed_backends_ucx_can_be_asked() -> None:
    nixl = ucx_config.backend_settings("NIXL")
    assert nixl and all(s is not None and set(ALL) <= s.keys() for s in nixl)
    assert ucx_config.backend_settings("MOONCAKE") == []


_CHILD = """
import sys
from nixl_cu12._api import nixl_agent, nixl_agent_config
nixl_agent("t", nixl_agent_config(backends=["UCX"]))
from kvxferd.backends import cma
print("DECISION", cma.cma_writes("NIXL"), flush=True)
"""


def _nixl_uses_cma(log: str) -> bool:
    """From NIXL's UCX debug log: its cma transport was loaded and kept."""
    return (
        "libuct_cma" in log and "closing md cma" not in log and "module is disabled: cma" not in log
    )


@pytest.mark.parametrize(
    ("case", "env", "home", "cwd"),
    [
        ("default", {}, "", ""),
        ("env tcp", {"UCX_TLS": "tcp"}, "", ""),
        ("env tcp and sm", {"UCX_TLS": "tcp,sm,self"}, "", ""),
        ("home tcp", {}, "UCX_TLS=tcp\n", ""),
        ("cwd colon", {}, "", "UCX_TLS: ^cma\n"),
        ("cwd continued", {}, "", "UCX_TLS=all\n    tcp\n"),
        ("env no shm devices", {"UCX_SHM_DEVICES": "none"}, "", ""),
        ("cwd no cma module", {}, "", "UCX_MODULES=^cma\n"),
    ],
)
def test_the_decision_matches_what_nixls_ucx_does(
    tmp_path: Path, case: str, env: dict[str, str], home: str, cwd: str
) -> None:
    home_dir, work_dir = tmp_path / "home", tmp_path / "work"
    home_dir.mkdir()
    work_dir.mkdir()
    if home:
        (home_dir / "ucx.conf").write_text(home)
    if cwd:
        (work_dir / "ucx.conf").write_text(cwd)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    child_env.update(env, HOME=str(home_dir), UCX_LOG_LEVEL="debug")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=child_env,
        cwd=work_dir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # (UCX's debug log quotes the command line, marker and all: the printed line counts.)
    (line,) = [each for each in out.stdout.splitlines() if each.startswith("DECISION ")]
    decision = line.split()[1] == "True"
    uses = _nixl_uses_cma(out.stdout + out.stderr)
    assert decision == uses, (case, decision, uses)
    if case in ("default", "env tcp and sm"):
        assert uses, "this host's UCX uses CMA by default"  # else the cases prove little


def test_a_system_ucx_is_found_where_the_process_mapped_it(tmp_path: Path) -> None:
    """A backend built against the system's UCX (no wheel copy): the mapped libraries."""
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 11 /usr/lib/x86_64-linux-gnu/libucp.so.0.0.0\n"
        "7f01-7f02 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libucs_signal.so.0\n"
        "7f02-7f03 r-xp 00000000 08:01 13 /usr/lib/x86_64-linux-gnu/libucs.so.0.0.0\n"
        "7f03-7f04 r-xp 00000000 08:01 14 /opt/half/libucp.so.0 (deleted)\n"
        "7f04-7f05 rw-p 00000000 00:00 0 [heap]\n"
    )
    assert ucx_config.loaded_libraries(str(maps)) == [
        (
            Path("/usr/lib/x86_64-linux-gnu/libucp.so.0.0.0"),
            Path("/usr/lib/x86_64-linux-gnu/libucs.so.0.0.0"),
        )
    ]
    assert ucx_config.loaded_libraries(str(tmp_path / "absent")) == []


def test_no_ucx_to_ask_is_said_and_counts_as_no_cma(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cma, "ptrace_allows_cma", lambda: True)
    monkeypatch.setattr(cma, "writev_works", lambda: True)
    with caplog.at_level("WARNING", logger="kvxferd.backends"):
        assert cma.cma_writes("UCX", lambda b: []) is False
    assert "found no UCX library of the UCX backend" in caplog.text

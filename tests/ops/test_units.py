"""deploy/: the systemd units pass `systemd-analyze verify` without a single
complaint, and keep the settings the daemon relies on."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
INSTALLED = "/opt/kvxferd/venv/bin/kvxferd"


def _verify(unit: Path, tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (scripts/test-deps.sh installs systemd)")
    # verify insists that ExecStart's program exists: point it at this checkout's
    # kvxferd instead of the documented install path; nothing else is changed.
    here = Path(sys.executable).with_name("kvxferd")
    assert here.exists(), here
    text = unit.read_text()
    assert INSTALLED in text
    copy = tmp_path / name
    copy.write_text(text.replace(INSTALLED, str(here)))
    return subprocess.run(
        [analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("unit", "as_name"),
    [("kvxferd.service", "kvxferd.service"), ("kvxferd@.service", "kvxferd@ctx0.service")],
)
def test_systemd_analyze_verify_is_clean(unit: str, as_name: str, tmp_path: Path) -> None:
    result = _verify(DEPLOY / unit, tmp_path, as_name)
    assert result.returncode == 0, result.stderr
    # Unknown keys and bad values are only warnings: there must be none.
    assert not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


def _service(unit: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((DEPLOY / unit).read_text())
    return parser["Service"]


@pytest.mark.parametrize("unit", ["kvxferd.service", "kvxferd@.service"])
def test_units_keep_what_the_daemon_relies_on(unit: str) -> None:
    s = _service(unit)
    assert s["Type"] in ("notify", "notify-reload")
    if s["Type"] == "notify":
        assert s["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert s["NotifyAccess"] == "main"
    assert s["WatchdogSec"] and s["Restart"] == "on-failure"
    # The engine's pools live in /dev/shm: nothing may hide the host's /dev or IPC.
    assert s.get("PrivateDevices", "no") == "no"
    assert s.get("PrivateIPC", "no") == "no"
    assert s.get("PrivateNetwork", "no") == "no"
    families = s["RestrictAddressFamilies"].split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families)
    # Longer than the default 30 s drain, or a drain would end in SIGKILL.
    assert int(s["TimeoutStopSec"].rstrip("s")) > 30
    assert s["RuntimeDirectory"] == "kvxferd"


def test_template_reads_one_file_per_instance() -> None:
    s = _service("kvxferd@.service")
    assert s["ExecStart"].endswith("--config /etc/kvxferd/%i.yaml")
    assert s["RuntimeDirectoryPreserve"] == "yes"  # shared by the instances

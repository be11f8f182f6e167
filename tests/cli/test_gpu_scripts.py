"""The GPU check's shell side: the wheel fetcher (dry run), the wheel stripper, gpu-check.sh."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _pins() -> dict[str, str]:
    text = (SCRIPTS / "fetch-gpu-wheels.sh").read_text()
    block = text[text.index("WHEELS=(") : text.index(")", text.index("WHEELS=("))]
    return dict(re.findall(r"([a-z0-9-]+)==([0-9][^\s]*)", block))


def test_fetch_dry_run_prints_the_pip_download() -> None:
    proc = subprocess.run(
        ["bash", str(SCRIPTS / "fetch-gpu-wheels.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in words and "--only-binary=:all:" in words
    assert words[words.index("--python-version") + 1] == "3.12"
    assert words[words.index("--implementation") + 1] == "cp"
    assert words[words.index("-d") + 1] == ".whl"
    assert "manylinux_2_28_x86_64" in words and "manylinux2014_x86_64" in words
    pins = _pins()
    assert set(pins) == {
        "nixl-cu13",
        "msgspec",
        "pydantic",
        "pydantic-core",
        "annotated-types",
        "typing-inspection",
        "typing-extensions",
    }
    for name, version in pins.items():
        assert f"{name}=={version}" in words


def test_fetch_pins_are_this_venvs_versions() -> None:
    """The GPU machine must run what the tests here ran."""
    pins = _pins()
    for name, version in pins.items():
        here = "nixl-cu12" if name == "nixl-cu13" else name
        try:
            installed = importlib.metadata.version(here)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert installed == version, f"{name}: pinned {version}, this venv has {installed}"


# -- strip_wheel.py --------------------------------------------------------------------------

_KEPT = [
    "nixl_cu13/__init__.py",
    "nixl_cu13/_bindings.cpython-312-x86_64-linux-gnu.so",
    "nixl_cu13.libs/libnixl-1234.so",
    "nixl_cu13.libs/ucx/libuct_cuda-5678.so.0.0.0",
    ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so",
    ".nixl_cu13.mesonpy.libs/plugins/libplugin_GDS.so",
    "nixl_cu13.scripts/nixl_example",
    "nixl_cu13-1.5.1.dist-info/METADATA",
    "nixl_cu13-1.5.1.dist-info/WHEEL",
]
_DROPPED = [
    "nixl_ep_cu13/__init__.py",
    "nixl_ep_cu13/nixl_ep_cpp_torch214.cpython-312-x86_64-linux-gnu.so",
    "nixl_cu13.libs/ucx/libucx_perftest_cuda.so.0.0.0",
    "nixl_cu13-1.5.1.data/headers/nixl.h",
]
_RECORD = "nixl_cu13-1.5.1.dist-info/RECORD"


def _wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name in _KEPT + _DROPPED:
            info = zipfile.ZipInfo(name)
            mode = 0o755 if name.endswith("nixl_example") else 0o644
            info.external_attr = (stat.S_IFREG | mode) << 16
            z.writestr(info, f"contents of {name}\n" * 10)
        record = "".join(f"{n},sha256=x,{len(n)}\n" for n in _KEPT + _DROPPED) + f"{_RECORD},,\n"
        z.writestr(_RECORD, record)
    return path


def _strip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "strip_wheel.py"), *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_strip_wheel_drops_exactly_the_listed_members_and_their_record_lines(
    tmp_path: Path,
) -> None:
    wheel = _wheel(tmp_path / "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl")
    listed = _strip(str(wheel), "--dry-run")
    assert listed.returncode == 0 and listed.stdout.split() == _DROPPED

    proc = _strip(str(wheel))
    assert proc.returncode == 0, proc.stderr
    assert "dropped 4 members" in proc.stdout
    with zipfile.ZipFile(wheel) as z:
        assert sorted(z.namelist()) == sorted([*_KEPT, _RECORD])
        record = z.read(_RECORD).decode().splitlines()
        assert [line.split(",")[0] for line in record] == [*_KEPT, _RECORD]
        assert z.read(_KEPT[0]) == f"contents of {_KEPT[0]}\n".encode() * 10
        mode = z.getinfo("nixl_cu13.scripts/nixl_example").external_attr >> 16
        assert mode & 0o111, "an executable member lost its mode"
        assert z.testzip() is None


def test_strip_wheel_more_drops_only_the_non_ucx_plugins(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "w.whl")
    out = tmp_path / "out.whl"
    assert _strip(str(wheel), "--more", "--out", str(out)).returncode == 0
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
    assert ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so" in names
    assert ".nixl_cu13.mesonpy.libs/plugins/libplugin_GDS.so" not in names
    assert zipfile.ZipFile(wheel).namelist() == [*_KEPT, *_DROPPED, _RECORD]  # input untouched


def test_strip_wheel_refuses_to_drop_the_metadata(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "w.whl")
    proc = _strip(str(wheel), "--drop", "*.dist-info/*")
    assert proc.returncode != 0 and "refusing to drop" in proc.stderr
    assert len(zipfile.ZipFile(wheel).namelist()) == len(_KEPT) + len(_DROPPED) + 1


# -- gpu-check.sh ----------------------------------------------------------------------------


def _gpu_check(out: Path, wheels: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_WHEELS": str(wheels),
        "GPU_CHECK_SITE": str(tmp_path / "site"),
        "GPU_CHECK_BUDGET_S": "60",
        "GPU_CHECK_TIMEOUT_S": "120",
    }
    env.pop("OUT", None)
    return subprocess.run(
        ["bash", str(SCRIPTS / "gpu-check.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def test_gpu_check_without_wheels_or_gpu_exits_2_with_json_and_log(tmp_path: Path) -> None:
    pytest.importorskip("kvxferd.bench.gpucheck")
    wheels = tmp_path / "no-wheels"
    wheels.mkdir()
    out = tmp_path / "out"
    proc = _gpu_check(out, wheels, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    doc = json.loads((out / "gpu-check.json").read_text())
    assert doc["schema"] == "kvxferd-gpu-check/1"
    assert doc["steps"]["setup"]["ok"] is False and doc["pass"]["all"] is False
    log = (out / "gpu-check.log").read_text()
    assert "no " in log and "using" in log  # it said it used the Python's own packages
    assert "GPU check (kvxferd-gpu-check/1)" in log and "gpu-check: exit 2" in log
    assert (out / "gpu-check-logs.tar.gz").exists()


def test_gpu_check_exits_3_when_the_wheels_do_not_install(tmp_path: Path) -> None:
    wheels = tmp_path / "bad-wheels"
    wheels.mkdir()
    (wheels / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    out = tmp_path / "out"
    proc = _gpu_check(out, wheels, tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "did not install" in (out / "gpu-check.log").read_text()
    assert not (out / "gpu-check.json").exists()

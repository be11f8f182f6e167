"""kvxferd.memory.device without a GPU: nothing imports cupy until asked, the probe never
raises and says why no device is usable, and every call that needs a device is refused
with DeviceUnavailableError carrying that reason. Nothing here claims that a GPU ran: with
a real cupy and a real device present, the tests that need "no device" skip."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvxferd
from kvxferd.errors import KvxferdError
from kvxferd.memory import device, vmm
from kvxferd.memory.device import DeviceRegion, DeviceUnavailableError, probe

REPO_ROOT = Path(kvxferd.__file__).resolve().parent.parent


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    """Each test probes anew, and leaves no probe of a fake cupy behind."""
    probe(refresh=True)
    yield
    probe(refresh=True)


def _no_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes `import cupy` raise ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, "cupy", None)  # type: ignore[arg-type]


def test_importing_the_daemon_client_and_bounce_leaves_cupy_unimported() -> None:
    code = textwrap.dedent(
        """
        import sys
        import kvxferd.memory.device, kvxferd.memory.vmm, kvxferd.memory
        import kvxferd.transceiver.bounce, kvxferd.service.daemon, kvxferd.client
        # (A bare "cuda" namespace package may be there from the start: cuda-bindings'
        # .pth files; what must not load is cupy or the driver bindings.)
        leaked = sorted(m for m in sys.modules if m.startswith(("cupy", "cuda.bindings")))
        print(leaked)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_without_cupy_the_probe_names_the_packages_to_install(
    monkeypatch: pytest.MonkeyPatch, fresh_probe: None
) -> None:
    _no_cupy(monkeypatch)
    found = probe(refresh=True)
    assert found.available is False
    assert "cupy is not installed" in found.why
    assert "cupy-cuda12x" in found.why and "cupy-cuda13x" in found.why
    assert found.count == 0 and found.cupy_version == ""
    assert probe() is found  # cached: one probe per process


class FakeCUDARuntimeError(RuntimeError):
    pass


def _fake_cupy(fail: str = "", count: int = 1) -> types.ModuleType:
    """A module with cupy's names for what the probe calls: getDeviceCount raises `fail`."""

    def get_device_count() -> int:
        if fail:
            raise FakeCUDARuntimeError(fail)
        return count

    runtime = types.SimpleNamespace(
        getDeviceCount=get_device_count,
        runtimeGetVersion=lambda: 12090,
        driverGetVersion=lambda: 0,
        CUDARuntimeError=FakeCUDARuntimeError,
    )
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "14.0.0"  # type: ignore[attr-defined]
    cupy.cuda = types.SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    return cupy


INSUFFICIENT = "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime"


def test_a_cuda_error_from_cupy_is_the_reason(
    monkeypatch: pytest.MonkeyPatch, fresh_probe: None
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(fail=INSUFFICIENT))
    found = probe(refresh=True)
    assert found.available is False
    assert found.why == f"no usable CUDA device: {INSUFFICIENT}"
    assert found.cupy_version == "14.0.0"


def test_no_device_seen_is_a_reason_too(monkeypatch: pytest.MonkeyPatch, fresh_probe: None) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(count=0))
    found = probe(refresh=True)
    assert found.available is False
    assert "no usable CUDA device" in found.why and "CUDA_VISIBLE_DEVICES" in found.why
    assert found.runtime_version == 12090


def test_a_device_found_is_reported_with_its_versions(
    monkeypatch: pytest.MonkeyPatch, fresh_probe: None
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(count=2))
    found = probe(refresh=True)
    assert (found.available, found.why, found.count) == (True, "", 2)
    assert (found.runtime_version, found.driver_version) == (12090, 0)
    # A device the process does not see is refused by ordinal, before cupy is touched.
    with pytest.raises(DeviceUnavailableError, match="CUDA device 5 does not exist here"):
        DeviceRegion.allocate(4096, 5, "staging")


def test_a_cupy_that_fails_to_import_is_a_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_probe: None
) -> None:
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text("raise OSError('libcudart.so.12: nope')\n")
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = probe(refresh=True)
    assert found.available is False
    assert found.why == "cupy does not import: OSError: libcudart.so.12: nope"
    monkeypatch.delitem(sys.modules, "cupy", raising=False)


def test_every_device_call_is_refused_with_the_probes_reason(
    monkeypatch: pytest.MonkeyPatch, fresh_probe: None
) -> None:
    _no_cupy(monkeypatch)
    why = probe(refresh=True).why
    calls = [
        lambda: DeviceRegion.open_ipc(b"\0" * 64, 0, 4096, 0),
        lambda: DeviceRegion.allocate(4096, 0, "staging"),
        lambda: DeviceRegion.import_vmm(-1, 4096, 0),
        lambda: device.DevicePool.create(4096, 0),
        lambda: device.DevicePool.create(4096, 0, vmm=True),
        lambda: device.uuid_of(0),
        lambda: device.ordinal_of("GPU-00000000-0000-0000-0000-000000000000"),
        lambda: device.export_ipc(0x1000, base=0x1000),
    ]
    for call in calls:
        with pytest.raises(DeviceUnavailableError) as caught:
            call()
        assert str(caught.value) == why
        assert isinstance(caught.value, KvxferdError)  # the CLI prints it without a traceback


def test_the_real_cupy_if_installed_finds_no_device_here(fresh_probe: None) -> None:
    pytest.importorskip("cupy")
    found = probe(refresh=True)
    if found.available:
        pytest.skip("a CUDA device is usable here: the no-device tests do not apply")
    assert found.why.startswith(("no usable CUDA device:", "cupy does not import:"))
    with pytest.raises(DeviceUnavailableError, match=r"no usable CUDA device|cupy does not"):
        DeviceRegion.open_ipc(b"\0" * 64, 0, 4096, 0)


def test_vmm_without_a_driver_says_so() -> None:
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        expected = "pip install cuda-bindings"
    else:
        expected = "no usable CUDA driver"
    if probe().available:
        pytest.skip("a CUDA device is usable here")
    for call in (lambda: vmm.create_exportable(1 << 21, 0), lambda: vmm.import_fd(0, 1 << 21, 0)):
        with pytest.raises(DeviceUnavailableError, match=expected):
            call()


def test_uuids_print_as_nvidia_smi_does() -> None:
    raw = bytes(range(16))
    text = device._uuid_text(raw)
    assert text == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert device._uuid_text(text) == text
    assert device._canonical(text.upper()) == device._canonical(text[4:])

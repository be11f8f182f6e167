"""NIXL memory kinds and module choice: host registrations and writes as before, VRAM
refused with NIXL's own reason on a host without CUDA, the wheel (nixl_cu12 or nixl_cu13)
chosen by one function, and the host-only backends refusing device memory."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvxferd.backends import nixl as nixl_mod
from kvxferd.backends import registry
from kvxferd.backends.base import HOST, Memory, host_only, vram
from kvxferd.backends.nixl import MODULE_ENV, NIXL_MODULES, load_nixl, nixl_module_name
from kvxferd.backends.twosided import NoOneSidedBackend
from kvxferd.errors import BackendUnavailableError, StartupError, TransferError

REPO = Path(__file__).resolve().parents[2]

# Real NIXL agents run in a child process: the test process must never load UCX (its
# variables and threads would reach every daemon a later test starts; tests/conftest.py).
_AGENTS = """
import json, sys
import numpy as np
from kvxferd.backends.base import HOST, vram
from kvxferd.backends.nixl import NixlBackend
from kvxferd.errors import StartupError

out = {}
a, b = NixlBackend("mem-a"), NixlBackend("mem-b")
out["module"] = a.module
src = np.arange(1 << 16, dtype=np.uint8); dst = np.zeros_like(src)
# HOST spelled out and left to the default: both are today's DRAM registration.
a.register(src.ctypes.data, src.nbytes, HOST); b.register(dst.ctypes.data, dst.nbytes)
peer = a.add_peer(b.metadata()); a.connect(peer)
seg = lambda arr: np.array([[arr.ctypes.data, arr.nbytes]], dtype=np.int64)
handle, status = a.post_write(seg(src), seg(dst), peer, local_memory=HOST, remote_memory=HOST)
while int(status) == 0:
    status = a.poll(handle)
out["write"] = int(status) == 1 and bool((src == dst).all())

# Host memory named VRAM: UCX without CUDA (this host) sees host memory and refuses.
other = np.zeros(1 << 16, dtype=np.uint8)
try:
    a.register(other.ctypes.data, other.nbytes, vram(0))
    out["vram"] = "registered"
except StartupError as exc:
    out["vram"] = str(exc)
print("RESULT " + json.dumps(out))
"""


def _needs_nixl() -> None:
    if nixl_module_name() is None or importlib.util.find_spec(nixl_module_name() or "") is None:
        pytest.skip("NIXL is not installed (scripts/install.sh)")


def test_host_memory_registers_and_writes_as_before_and_vram_is_refused() -> None:
    _needs_nixl()
    res = subprocess.run(
        [sys.executable, "-c", _AGENTS],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout + res.stderr[-3000:]
    out: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    assert out["module"] == nixl_module_name()
    assert out["write"] is True
    # This host has no CUDA: NIXL must refuse, and the message must keep NIXL's own status
    # and name what was asked and the likely cause.
    assert out["vram"] != "registered"
    assert "as VRAM on CUDA device 0" in out["vram"]
    assert "NIXL_ERR" in out["vram"]
    assert "lacks CUDA support" in out["vram"]


def test_descriptors_carry_the_device_column() -> None:
    """Both forms: tuples for a few segments, an Nx3 array for more."""
    segs = np.array([[4096, 100], [8192, 200]], dtype=np.int64)
    assert nixl_mod._descs(segs) == [(4096, 100, 0), (8192, 200, 0)]
    assert nixl_mod._descs(segs, 3) == [(4096, 100, 3), (8192, 200, 3)]
    many = np.array([[4096 * (i + 1), 100 + i] for i in range(9)], dtype=np.int64)
    as_array = nixl_mod._descs(many, 3)
    assert isinstance(as_array, np.ndarray)
    assert as_array.tolist() == [[4096 * (i + 1), 100 + i, 3] for i in range(9)]


class _RecordingAgent:
    """Stands in for nixl_agent: records the memory kinds NIXL is asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, str]] = []

    def register_memory(self, descs: Any, kind: str) -> object:
        self.calls.append(("register", descs, kind))
        return object()

    def get_xfer_descs(self, descs: Any, kind: str) -> Any:
        self.calls.append(("xfer", np.asarray(descs).tolist(), kind))
        return descs

    def initialize_xfer(self, *args: Any) -> object:
        return object()

    def transfer(self, native: object) -> str:
        return "PROC"


def _backend_with(agent: _RecordingAgent) -> nixl_mod.NixlBackend:
    backend = nixl_mod.NixlBackend.__new__(nixl_mod.NixlBackend)  # no real agent
    backend.agent_name = "rec"
    backend._agent = agent
    backend._prepared = nixl_mod.PreparedLists(agent)  # no regions told: never prepares
    return backend


def test_register_and_post_name_each_sides_memory_kind() -> None:
    agent = _RecordingAgent()
    backend = _backend_with(agent)
    backend.register(0x1000, 4096)
    backend.register(0x2000, 4096, vram(2))
    assert agent.calls == [
        ("register", [(0x1000, 4096, 0, "")], "DRAM"),
        ("register", [(0x2000, 4096, 2, "")], "VRAM"),
    ]
    agent.calls.clear()
    seg = np.array([[0x2000, 64]], dtype=np.int64)
    backend.post_write(seg, seg, "peer", local_memory=vram(2), remote_memory=vram(5))
    backend.post_write(seg, seg, "peer")
    assert agent.calls == [
        ("xfer", [[0x2000, 64, 2]], "VRAM"),
        ("xfer", [[0x2000, 64, 5]], "VRAM"),
        ("xfer", [[0x2000, 64, 0]], "DRAM"),
        ("xfer", [[0x2000, 64, 0]], "DRAM"),
    ]


def _only(monkeypatch: pytest.MonkeyPatch, installed: set[str]) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> importlib.machinery.ModuleSpec | None:
        if name in NIXL_MODULES:
            return importlib.machinery.ModuleSpec(name, None) if name in installed else None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_module_name_is_the_installed_one_cu12_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODULE_ENV, raising=False)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)  # no device known: no preference
    _only(monkeypatch, {"nixl_cu13"})
    assert nixl_module_name() == "nixl_cu13"
    assert registry.package_of("NIXL") == "nixl_cu13"
    _only(monkeypatch, {"nixl_cu12", "nixl_cu13"})
    assert nixl_module_name() == "nixl_cu12"
    _only(monkeypatch, set())
    assert nixl_module_name() is None


def test_module_name_prefers_the_drivers_cuda_major(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODULE_ENV, raising=False)
    _only(monkeypatch, {"nixl_cu12", "nixl_cu13"})
    monkeypatch.setattr(nixl_mod, "_driver_major", lambda: 13)
    assert nixl_module_name() == "nixl_cu13"
    monkeypatch.setattr(nixl_mod, "_driver_major", lambda: 12)
    assert nixl_module_name() == "nixl_cu12"


def test_no_device_is_probed_unless_cupy_is_already_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert nixl_mod._driver_major() is None
    assert "cupy" not in sys.modules


def test_module_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    _only(monkeypatch, {"nixl_cu12"})
    monkeypatch.setenv(MODULE_ENV, "nixl_cu13")
    # A None entry makes the import fail for real, also where nixl-cu13 is installed (the
    # GPU machine has it): the override must be obeyed, not quietly swapped for cu12.
    monkeypatch.setitem(sys.modules, "nixl_cu13", None)
    assert nixl_module_name() == "nixl_cu13"
    with pytest.raises(BackendUnavailableError) as info:
        load_nixl()
    text = str(info.value)
    assert "nixl-cu12 or nixl-cu13" in text and f"{MODULE_ENV}=nixl_cu13" in text


def test_neither_installed_names_both_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODULE_ENV, raising=False)
    _only(monkeypatch, set())
    with pytest.raises(BackendUnavailableError) as info:
        load_nixl()
    text = str(info.value)
    assert "nixl-cu12 or nixl-cu13" in text and "neither is installed" in text
    assert registry.package_of("NIXL") == "nixl_cu12"  # what the probes report missing


def test_the_installed_module_is_reported() -> None:
    found = nixl_module_name()
    if found is None:
        pytest.skip("NIXL is not installed (scripts/install.sh)")
    assert importlib.util.find_spec(found) is not None
    assert registry.PACKAGES["NIXL"] in NIXL_MODULES


def test_host_only_backends_refuse_device_memory() -> None:
    assert host_only("UCX", HOST, HOST) is None
    assert host_only("UCX", HOST, vram(1)) == (
        "backend UCX moves host memory only; device pools need NIXL"
    )
    for name in ("UCX", "MPI"):
        plane = NoOneSidedBackend(name, "agent")
        assert plane.register(0x1000, 4096) is None  # host: nothing to register, as before
        with pytest.raises(StartupError, match=f"backend {name} moves host memory only"):
            plane.register(0x1000, 4096, vram(0))
        seg = np.array([[0x1000, 64]], dtype=np.int64)
        with pytest.raises(TransferError, match="device pools need NIXL"):
            plane.post_write(seg, seg, "peer", remote_memory=Memory("VRAM", 0))
        with pytest.raises(TransferError, match="no one-sided writes"):
            plane.post_write(seg, seg, "peer")


def test_mooncake_refuses_device_memory_before_touching_its_engine() -> None:
    from kvxferd.backends.mooncake import MooncakeBackend

    # No engine is needed: the refusal comes first (Mooncake need not be installed).
    backend = MooncakeBackend.__new__(MooncakeBackend)
    backend.agent_name = "mc"
    with pytest.raises(StartupError, match="backend MOONCAKE moves host memory only"):
        backend.register(0x1000, 4096, vram(0))
    seg = np.array([[0x1000, 64]], dtype=np.int64)
    with pytest.raises(TransferError, match="device pools need NIXL"):
        backend.post_write(seg, seg, "peer", local_memory=vram(0))


def test_the_staged_runtime_asks_for_a_mutex_worker_lock_unless_the_operator_chose() -> None:
    from kvxferd.backends.nixl import UCX_MUTEX_ENV, prefer_mutex_worker_lock

    env: dict[str, str] = {}
    assert prefer_mutex_worker_lock(env) is True
    assert env == {UCX_MUTEX_ENV: "y"}
    chosen = {UCX_MUTEX_ENV: "n"}
    assert prefer_mutex_worker_lock(chosen) is False
    assert chosen == {UCX_MUTEX_ENV: "n"}  # the operator's choice stands


def test_the_tests_take_the_nixl_the_daemons_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/nixl_harness: the module nixl_module_name picks (nixl-cu13 on the GPU machine,
    where a test asking for nixl_cu12 by name skipped), and a skip naming why without one."""
    import nixl_harness

    name = nixl_module_name()
    if name is not None:
        assert nixl_harness.nixl_or_skip().__name__ == name
    monkeypatch.setattr(nixl_harness, "nixl_module_name", lambda: None)
    with pytest.raises(pytest.skip.Exception, match="needs NIXL here"):
        nixl_harness.nixl_or_skip("needs NIXL here")

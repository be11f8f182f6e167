"""NIXL for the GPU check's probes (kvxferd.bench.gpu_probes): which NIXL module imports and
its version, and NixlSide, an agent with one registered region that writes to a peer.

NIXL is driven through its Python API exactly as kvxferd/backends/nixl.py does (agent with the
UCX backend and no listen thread, register_memory([(addr, len, dev, "")], mem), metadata by
value, get_xfer_descs on (N, 3) uint64 arrays, initialize_xfer("WRITE"), transfer,
check_xfer_state, release). Apart from the roles so that this one place says how; NIXL is
imported inside the functions, so this module imports on a host without it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import time
from contextlib import suppress
from typing import Any

import numpy as np

#: The NIXL Python modules, preferred first: the GPU machine has CUDA 13.
NIXL_MODULES = ("nixl_cu13", "nixl_cu12")


def nixl_module() -> tuple[Any, str]:
    """The NIXL Python module that imports here, cu13 first."""
    errors = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name), name
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("no NIXL module imports (" + "; ".join(errors) + ")")


def nixl_version(module_name: str) -> str | None:
    try:
        return importlib.metadata.version(module_name.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return None


def descs(addr: int, nbytes: int, device: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.array([[addr, nbytes, device]], dtype=np.uint64)


class NixlSide:
    """A NIXL agent with one registered region, as kvxferd's NixlBackend drives it."""

    def __init__(self, name: str, ptr: int, nbytes: int, device: int, mem: str = "VRAM") -> None:
        nixl, self.module = nixl_module()
        conf = nixl.nixl_agent_config(enable_listen_thread=False, backends=["UCX"])
        self.agent = nixl.nixl_agent(name, conf)
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"NIXL agent has no UCX backend ({self.agent.get_plugin_list()})")
        self.name = name
        self.ptr, self.nbytes, self.device, self.mem = ptr, nbytes, device, mem
        self.registration: Any = None

    def register(self) -> None:
        self.registration = self.agent.register_memory(
            [(self.ptr, self.nbytes, self.device, "")], self.mem
        )

    def metadata(self) -> str:
        return bytes(self.agent.get_agent_metadata()).hex()

    def add_peer(self, metadata_hex: str) -> str:
        name = self.agent.add_remote_agent(bytes.fromhex(metadata_hex))
        peer = name.decode() if isinstance(name, bytes) else str(name)
        self.agent.make_connection(peer)
        return peer

    def write(
        self, peer: str, remote_addr: int, remote_device: int, nbytes: int, timeout_s: float = 30.0
    ) -> float:
        """One WRITE of our first `nbytes` to the peer's `remote_addr`, busy-polled; returns
        milliseconds from building the transfer to DONE (what kvxferd.bench.raw times)."""
        agent = self.agent
        t0 = time.perf_counter_ns()
        local = agent.get_xfer_descs(descs(self.ptr, nbytes, self.device), self.mem)
        remote = agent.get_xfer_descs(descs(remote_addr, nbytes, remote_device), "VRAM")
        handle = agent.initialize_xfer("WRITE", local, remote, peer, b"")
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL write of {nbytes} bytes not done in {timeout_s} s")
                state = agent.check_xfer_state(handle)
            t1 = time.perf_counter_ns()
            if state != "DONE":
                raise RuntimeError(f"NIXL write ended in state {state!r}")
        finally:
            agent.release_xfer_handle(handle)
        return (t1 - t0) / 1e6

    def close(self) -> None:
        if self.registration is not None:
            with suppress(Exception):
                self.agent.deregister_memory(self.registration)
            self.registration = None

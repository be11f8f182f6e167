"""GPU (vram) pools against real daemons on a host without a usable CUDA device.

Nothing here runs on a GPU, and nothing claims to: what this host can show honestly is
every refusal. A GPU pool offered to a host daemon is refused `device_unavailable`, naming
the CUDA probe's reason (the daemon runs in this same environment, so the probe here says
what the daemon's said); the daemon goes on serving host pools, byte for byte. A daemon
configured `engine.kv_memory: vram` exits at start with a StartupError saying why.
Malformed registrations (the exactly-one rule per memory kind) are `bad_request`, and a
handoff token of one kind (memfd, cuda_vmm) cannot register a pool of the other.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from daemon_harness import (
    assert_clean,
    healthy,
    layout_for,
    opened,
    status,
    transfer_one,
)

from kvxferd.api.handoff import hand_off_fd
from kvxferd.api.messages import RegisterPool, Reply
from kvxferd.client import AsyncClient, CallError
from kvxferd.commands.status_cmd import summary
from kvxferd.memory import MemfdRegion, device
from kvxferd.service.engine_calls import EngineCalls
from kvxferd.sim.cluster import DaemonProc, LocalCluster

Pair = tuple[DaemonProc, DaemonProc]

UUID = "GPU-00000000-0000-0000-0000-000000000000"
HANDLE = b"\0" * 64
LAYOUT = layout_for("block-major", 8)


@pytest.fixture(scope="module")
def no_device() -> device.DeviceProbe:
    """This host's CUDA probe, which must say there is no device (never claim a GPU)."""
    found = device.probe()
    if found.available:
        pytest.skip("a CUDA device is usable here: these tests check the refusals without one")
    assert found.why
    return found


def connect(daemon: DaemonProc) -> Any:
    return AsyncClient.connect(daemon.api_socket, engine="test-device")


async def refused(call: Any) -> CallError:
    with pytest.raises(CallError) as info:
        await call
    return info.value


async def refused_registration(client: Any, pool_id: str, **fields: Any) -> CallError:
    """A RegisterPool of LAYOUT's size and layout with `fields` (shm_name "" unless given),
    which must be refused."""
    return await refused(
        client._ask(
            RegisterPool,
            pool_id=pool_id,
            nbytes=LAYOUT.pool_bytes,
            layout=dict(LAYOUT.to_wire()),
            **{"shm_name": "", **fields},
        )
    )


def test_a_gpu_pool_is_refused_naming_why_and_host_pools_still_move(
    pair: Pair, no_device: device.DeviceProbe
) -> None:
    ctx, gen = pair

    async def main() -> None:
        client = await connect(gen)
        try:
            err = await refused(client.register_ipc_pool("gpu0", HANDLE, 0, LAYOUT, UUID))
        finally:
            await client.close()
        assert err.code == "device_unavailable", err
        assert "is in GPU memory (vram)" in err.message
        assert "no usable CUDA device" in err.message
        assert no_device.why in err.message
        assert "docs/engine-integration.md, 'GPU pools'" in err.message
        # Nothing of it stayed behind, and the daemon serves host pools as before.
        assert status(gen)["pools"] == []
        async with opened(ctx) as c, opened(gen) as g:
            await transfer_one(ctx, c, g, "after-gpu-refusal", 100)

    asyncio.run(main())
    assert_clean(ctx, gen)


def test_a_vram_daemon_exits_at_start_saying_why(
    cluster: LocalCluster, no_device: device.DeviceProbe
) -> None:
    d = cluster.start_daemon(
        "gpu",
        "context",
        wait=False,
        engine={"kv_memory": "vram"},
        transceiver={"kv_cache_bounce_size_mb": 16},
    )
    assert d.proc.wait(60) == 1
    text = d.log_text()
    assert "engine.kv_memory is vram in" in text, text[-2000:]
    assert "but this host has no usable CUDA device" in text
    assert no_device.why in text
    assert "Traceback" not in text


# (what the test calls the message, its RegisterPool fields beyond pool_id/layout/nbytes)
MALFORMED: list[tuple[str, dict[str, Any], str]] = [
    ("an unknown memory kind", {"memory": "gpu", "shm_name": "x"}, "memory must be one of"),
    ("a host pool with an IPC handle", {"shm_name": "x", "ipc_handle": HANDLE}, "host memory"),
    ("a host pool with a device UUID", {"shm_name": "x", "device_uuid": UUID}, "host memory"),
    ("a host pool shared no way", {}, "exactly one of handoff"),
    ("a host pool shared both ways", {"shm_name": "x", "handoff": "t"}, "exactly one of"),
    ("a GPU pool with a shm name", {"memory": "vram", "shm_name": "x"}, "names a shm object"),
    ("a GPU pool shared no way", {"memory": "vram", "device_uuid": UUID}, "exactly one of ipc"),
    (
        "a GPU pool shared both ways",
        {"memory": "vram", "device_uuid": UUID, "ipc_handle": HANDLE, "handoff": "t"},
        "exactly one of ipc_handle",
    ),
    (
        "a short IPC handle",
        {"memory": "vram", "device_uuid": UUID, "ipc_handle": b"\1" * 10},
        "64-byte cudaIpcMemHandle_t (got 10 bytes)",
    ),
    (
        "a negative IPC offset",
        {"memory": "vram", "device_uuid": UUID, "ipc_handle": HANDLE, "ipc_offset": -4096},
        "ipc_offset -4096 is invalid",
    ),
    (
        "an offset with a VMM fd",
        {"memory": "vram", "device_uuid": UUID, "handoff": "t", "ipc_offset": 8},
        "0 for a VMM fd",
    ),
    ("a GPU pool without a UUID", {"memory": "vram", "ipc_handle": HANDLE}, "device_uuid"),
]


@pytest.mark.parametrize(("what", "fields", "says"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_the_exactly_one_rule_per_memory_kind(
    pair: Pair, what: str, fields: dict[str, Any], says: str
) -> None:
    _, gen = pair

    async def main() -> None:
        client = await connect(gen)
        try:
            err = await refused_registration(client, "bad", **fields)
        finally:
            await client.close()
        assert err.code == "bad_request", (what, err)
        assert says in err.message, (what, err.message)

    asyncio.run(main())
    assert healthy(gen) and status(gen)["pools"] == []


@pytest.fixture
def memfd() -> Iterator[MemfdRegion]:
    region = MemfdRegion.create(LAYOUT.pool_bytes, "device-test")
    yield region
    region.close()


async def hand(daemon: DaemonProc, fd: int, pool_id: str, kind: str) -> Reply:
    return await asyncio.to_thread(
        hand_off_fd, daemon.api_socket, fd, pool_id, LAYOUT.pool_bytes, 5.0, kind
    )


def test_handoff_kinds_register_their_own_memory_only(
    pair: Pair, memfd: MemfdRegion, no_device: device.DeviceProbe
) -> None:
    _, gen = pair

    async def main() -> None:
        client = await connect(gen)
        try:
            # An fd handed as a CUDA VMM fd is not seal-checked (it has none), so a memfd
            # passes the handoff; it still cannot become a host pool.
            vmm = await hand(gen, memfd.fd, "p", "cuda_vmm")
            assert vmm.ok, vmm
            err = await refused_registration(client, "p", handoff=vmm.result)
            assert err.code == "bad_request"
            assert "handed over as a CUDA VMM fd (kind cuda_vmm)" in err.message
            assert "a host pool is registered with a sealed memfd" in err.message
            # A sealed memfd's token cannot register a GPU pool.
            host = await hand(gen, memfd.fd, "q", "memfd")
            assert host.ok, host
            err = await refused_registration(
                client, "q", memory="vram", device_uuid=UUID, handoff=host.result
            )
            assert err.code == "bad_request"
            assert "handed over as a sealed memfd (kind memfd)" in err.message
            # A kind the daemon does not know is refused at the handoff.
            odd = await hand(gen, memfd.fd, "r", "dmabuf")
            assert not odd.ok and odd.error == "bad_request"
            assert "unknown handoff kind 'dmabuf'" in odd.message
            # The public VMM route: handed over, then refused for want of a device.
            err = await refused(client.register_vmm_pool("v", memfd.fd, LAYOUT, UUID))
            assert err.code == "device_unavailable"
            assert no_device.why in err.message
        finally:
            await client.close()
        os.fstat(memfd.fd)  # the engine's own fd stays open

    asyncio.run(main())
    assert healthy(gen) and status(gen)["pools"] == []


def test_status_names_each_pools_memory(pair: Pair) -> None:
    ctx, gen = pair

    async def main() -> None:
        async with opened(ctx, pool_id="shown") as c, opened(gen, pool_id="shown") as g:
            await transfer_one(ctx, c, g, "status-memory", 64)
            doc = status(gen)
            assert doc["pool_memory"] == {
                "shown": {
                    "memory": "host",
                    "device": None,
                    "device_uuid": None,
                    "sharing": "shm",
                    "zero_copy": True,
                    # /dev/shm gives normal pages (kvxferd.memory.hugepages).
                    "pages": {
                        "kind": "4k",
                        "page_bytes": 4096,
                        "label": "4 KiB",
                        "reason": None,
                        "huge_bytes": None,
                    },
                }
            }
            assert doc["device"] is None  # a host daemon has no GPU block
            (peer,) = doc["peers"]
            assert peer["memory"] == {"shown": "host"}
            text = summary(doc)
            assert "  pool shown: host (shm, 4 KiB pages)" in text.splitlines()
            assert "GPU pools" not in text

    asyncio.run(main())
    assert_clean(ctx, gen)


def test_the_status_summary_of_a_gpu_daemon() -> None:
    # The CLI's lines for a vram daemon's document (its fields as daemon_status writes
    # them; no daemon with a GPU runs here).
    doc = {
        "pools": ["p0", "old"],
        "pool_memory": {
            "p0": {
                "memory": "vram",
                "device": 0,
                "device_uuid": UUID,
                "sharing": "cuda_ipc",
                "zero_copy": False,
            }
        },
        "device": {
            "kv_memory": "vram",
            "cuda_device": 0,
            "uuid": UUID,
            "cuda_runtime": 13000,
            "cuda_driver": 13000,
            "cupy": "14.2.0",
            "nixl_module": "nixl_cu13",
            "zero_copy": False,
        },
    }
    lines = summary(doc).splitlines()
    assert "  pool p0: vram cuda:0 (cuda_ipc, copy-only)" in lines
    assert "  pool old: host" in lines  # a row missing (an older daemon's): host
    assert (
        f"  GPU pools: cuda:0 ({UUID}), CUDA runtime 13000, driver 13000, cupy 14.2.0, "
        "NIXL module nixl_cu13, zero-copy off"
    ) in lines


# ------------------------------------------ the memory-kind decision, in-process


def calls(kv_memory: str) -> EngineCalls:
    """EngineCalls over just what the memory check reads of the daemon."""
    view = SimpleNamespace(
        settings=SimpleNamespace(kv_memory=kv_memory), cfg=SimpleNamespace(source="d.yaml")
    )

    async def announce() -> None:
        return None

    return EngineCalls(view, None, announce)  # type: ignore[arg-type]


def message(memory: str) -> RegisterPool:
    return RegisterPool(call_id=1, pool_id="p", shm_name="", nbytes=1, layout={}, memory=memory)


def test_a_gpu_pool_on_a_host_daemon_where_a_device_exists_is_a_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A probe that reports a device (monkeypatched: this host has none).
    monkeypatch.setattr(device, "probe", lambda: device.DeviceProbe(True, count=1))
    with pytest.raises(Exception) as info:
        calls("host")._check_memory(message("vram"))
    assert getattr(info.value, "code", None) == "memory_mismatch"
    assert "engine.kv_memory: host in d.yaml" in str(info.value)


def test_a_host_pool_on_a_vram_daemon_is_a_mismatch() -> None:
    with pytest.raises(Exception) as info:
        calls("vram")._check_memory(message("host"))
    assert getattr(info.value, "code", None) == "memory_mismatch"
    assert "configured for GPU pools (engine.kv_memory: vram in d.yaml)" in str(info.value)
    calls("vram")._check_memory(message("vram"))  # its own kind passes
    calls("host")._check_memory(message("host"))

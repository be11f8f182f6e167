"""The GPU-pool fields (issue 15) grew within PROTOCOL_VERSION 2: a build without them and a
build with them understand each other. The "old" structs below are copies of the messages
as they were before those fields, with the same tags; each direction is checked through
the codec the daemon itself decodes with."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.api.messages import (
    DAEMON_CODEC,
    ENGINE_CODEC,
    ApiError,
    PoolHandoff,
    RegisterPool,
    Reply,
)
from kvxferd.peers.messages import PEER_CODEC, Info, PoolInfo
from kvxferd.peers.process import ProcessInfo

LAYOUT: dict[str, object] = {"num_layers": 2, "kv_factor": 2, "major": "block-major"}


class _OldApiMsg(msgspec.Struct, tag_field="type"):
    pass


class OldRegisterPool(_OldApiMsg, tag="register_pool"):
    call_id: int
    pool_id: str
    shm_name: str
    nbytes: int
    layout: dict[str, object]
    tp_rank: int = 0
    tp_size: int = 1
    handoff: str = ""


class OldPoolHandoff(_OldApiMsg, tag="pool_handoff"):
    call_id: int
    version: int
    pool_id: str
    nbytes: int


class _OldPeerMsg(msgspec.Struct, tag_field="type", forbid_unknown_fields=False):
    pass


class OldPoolInfo(msgspec.Struct):
    pool_id: str
    layout: dict[str, object]
    base: int
    nbytes: int
    tp_rank: int = 0
    tp_size: int = 1


class OldInfo(_OldPeerMsg, tag="info"):
    agent_name: str
    agent_metadata: bytes
    pools: list[OldPoolInfo]
    fingerprint: str
    compat: dict[str, object]
    transceiver: dict[str, object]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    context_parallel_size: int
    bounce_base: int = 0
    bounce_nbytes: int = 0
    transport_address: str = ""
    process: ProcessInfo = msgspec.field(default_factory=ProcessInfo)
    wall_ms: int = 0


def _body(frame: bytes) -> bytes:
    return frame[4:]  # the codec's 4-byte length prefix


def _old_info(pools: list[OldPoolInfo]) -> OldInfo:
    return OldInfo(
        agent_name="ctx-0",
        agent_metadata=b"\x01meta",
        pools=pools,
        fingerprint="f" * 16,
        compat={"tokens_per_block": 16},
        transceiver={"runtime": "PYTHON"},
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        context_parallel_size=1,
        bounce_base=0x7000,
        bounce_nbytes=1 << 20,
        transport_address="",
        process=ProcessInfo("boot", "ns", 42, 7),
        wall_ms=1234,
    )


def _keys_in_order(data: bytes) -> list[str]:
    return list(msgspec.msgpack.decode(data))


def test_an_old_engines_register_pool_decodes_as_a_host_pool() -> None:
    old = OldRegisterPool(7, "p0", "", 4096, LAYOUT, 1, 2, "tok")
    new = ENGINE_CODEC.decode(msgspec.msgpack.encode(old))
    assert isinstance(new, RegisterPool)
    assert (new.call_id, new.pool_id, new.handoff, new.tp_rank, new.tp_size) == (
        7,
        "p0",
        "tok",
        1,
        2,
    )
    assert (new.memory, new.device_uuid, new.ipc_handle, new.ipc_offset) == ("host", "", b"", 0)


def test_an_old_daemon_reads_a_device_register_pool_without_the_new_fields() -> None:
    new = RegisterPool(
        7,
        "p0",
        "",
        4096,
        LAYOUT,
        memory="vram",
        device_uuid="GPU-00000000-0000-0000-0000-000000000000",
        ipc_handle=b"\x02" * 64,
        ipc_offset=512,
    )
    body = _body(ENGINE_CODEC.encode(new))
    old = msgspec.msgpack.decode(body, type=OldRegisterPool)
    # Neither shm_name nor handoff: an old daemon's exactly-one rule refuses it.
    assert (old.pool_id, old.shm_name, old.handoff, old.nbytes) == ("p0", "", "", 4096)
    # The fields an old build knows keep their places; the new ones come after them.
    old_keys = _keys_in_order(msgspec.msgpack.encode(old))
    assert _keys_in_order(body)[: len(old_keys)] == old_keys


def test_pool_handoff_kind_defaults_to_memfd_both_ways() -> None:
    new = ENGINE_CODEC.decode(msgspec.msgpack.encode(OldPoolHandoff(3, 2, "p0", 8192)))
    assert isinstance(new, PoolHandoff) and new.kind == "memfd"
    body = _body(ENGINE_CODEC.encode(PoolHandoff(3, 2, "p0", 8192, kind="cuda_vmm")))
    old = msgspec.msgpack.decode(body, type=OldPoolHandoff)
    assert (old.call_id, old.version, old.pool_id, old.nbytes) == (3, 2, "p0", 8192)


def test_an_old_peers_info_decodes_with_host_memory_everywhere() -> None:
    old = _old_info([OldPoolInfo("p0", LAYOUT, 0x1000, 4096, 0, 1)])
    new = PEER_CODEC.decode(msgspec.msgpack.encode(old))
    assert isinstance(new, Info)
    assert (new.bounce_memory, new.bounce_device, new.wall_ms) == ("host", 0, 1234)
    assert new.process == ProcessInfo("boot", "ns", 42, 7)
    # An old peer never said its UCX may use CMA: a writer here drains rather than cancels.
    assert new.ucx_cma is False
    (pool,) = new.pools
    assert isinstance(pool, PoolInfo)
    assert (pool.pool_id, pool.base, pool.nbytes) == ("p0", 0x1000, 4096)
    assert (pool.memory, pool.device, pool.writable) == ("host", 0, True)


@settings(max_examples=40, deadline=None)
@given(
    memory=st.sampled_from(["host", "vram"]),
    device=st.integers(0, 7),
    writable=st.booleans(),
    bounce=st.sampled_from(["host", "vram"]),
    pools=st.integers(0, 3),
)
def test_a_new_peers_info_decodes_in_an_old_build(
    memory: str, device: int, writable: bool, bounce: str, pools: int
) -> None:
    infos = [
        PoolInfo(f"p{i}", LAYOUT, 0x1000 * (i + 1), 4096, memory=memory, device=device)
        for i in range(pools)
    ]
    for p in infos:
        p.writable = writable
    fields: dict[str, Any] = {
        f: getattr(_old_info([]), f) for f in OldInfo.__struct_fields__ if f != "pools"
    }
    new = Info(**fields, pools=infos, bounce_memory=bounce, bounce_device=device)
    body = _body(PEER_CODEC.encode(new))
    old = msgspec.msgpack.decode(body, type=OldInfo)
    assert [(p.pool_id, p.base, p.nbytes) for p in old.pools] == [
        (p.pool_id, p.base, p.nbytes) for p in infos
    ]
    assert (old.bounce_base, old.wall_ms, old.process) == (new.bounce_base, 1234, new.process)
    # And back: the new build reads its own message whole.
    again = PEER_CODEC.decode(body)
    assert again == new
    old_keys = _keys_in_order(msgspec.msgpack.encode(old))
    assert _keys_in_order(body)[: len(old_keys)] == old_keys


def test_the_new_error_codes_travel_as_their_strings() -> None:
    for code, text in (
        (ApiError.DEVICE_UNAVAILABLE, "device_unavailable"),
        (ApiError.MEMORY_MISMATCH, "memory_mismatch"),
    ):
        reply = DAEMON_CODEC.decode(_body(DAEMON_CODEC.encode(Reply(1, False, code, "why"))))
        assert isinstance(reply, Reply) and reply.error == text

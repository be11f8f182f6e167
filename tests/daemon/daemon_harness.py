"""Helpers for the daemon tests: an in-test engine built on kvxferd.client, status
reads over HTTP, and deadline-bounded waits."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvxferd.backends import registry
from kvxferd.client import AsyncClient, CallError
from kvxferd.memory.layout import KvLayout
from kvxferd.memory.shm import ShmRegion
from kvxferd.sim.cluster import DEFAULT_GEOMETRY, DaemonProc
from kvxferd.sim.content import VerifyResult, clear_blocks, fill_blocks, request_seed, verify_blocks
from kvxferd.sim.workload import BlockAllocator


def staged_backends() -> list[Any]:
    """Every backend, as pytest params for staged-runtime tests.

    A backend this build has no adapter for is a failing param, not a skip: the
    suite must show what is missing. A missing package skips (scripts/install.sh
    installs them all).
    """
    params = []
    # Probed with find_spec, never imported here (see tests/conftest.py).
    for name, package in registry.PACKAGES.items():
        marks = []
        if name not in registry.available():
            marks.append(pytest.mark.xfail(reason=f"no {name} adapter in this build", strict=True))
        elif importlib.util.find_spec(package) is None:
            marks.append(
                pytest.mark.skip(reason=f"{package} is not installed (scripts/install.sh)")
            )
        params.append(pytest.param(name, marks=marks, id=name))
    return params


# Small geometry: 8 layers x 2 (K, V) x 32 tokens x 4 heads x 64 dims x fp16 = 256 KiB a block.
GEOMETRY = dict(DEFAULT_GEOMETRY)


def layout_for(
    major: str, num_blocks: int = 128, geometry: dict[str, Any] | None = None
) -> KvLayout:
    g = dict(GEOMETRY if geometry is None else geometry)
    return KvLayout(
        num_layers=g["num_layers"],
        kv_factor=2,
        num_kv_heads=g["num_kv_heads"],
        head_dim=g["head_dim"],
        tokens_per_block=g["tokens_per_block"],
        dtype=g["dtype"],
        major=major,
        num_blocks=num_blocks,
    )


class SimEngine:
    """A reference engine driven step by step from a test."""

    def __init__(self, client: AsyncClient, layout: KvLayout, pool_id: str) -> None:
        self.client = client
        self.layout = layout
        self.pool_id = pool_id
        self.region: ShmRegion | None = None
        self.alloc = BlockAllocator(layout.num_blocks)

    @classmethod
    async def open(
        cls,
        daemon: DaemonProc,
        major: str = "block-major",
        num_blocks: int = 128,
        pool_id: str = "pool0",
        geometry: dict[str, Any] | None = None,
    ) -> SimEngine:
        client = await AsyncClient.connect(daemon.api_socket, engine=f"test-{daemon.name}")
        engine = cls(client, layout_for(major, num_blocks, geometry), pool_id)
        name = f"kvxferd-test-{pool_id}-{os.getpid()}-{id(engine)}"
        engine.region = ShmRegion.create(name, engine.layout.pool_bytes)
        try:
            await client.register_pool(pool_id, name, engine.layout)
        finally:
            engine.region.unlink()
        return engine

    @property
    def pool(self) -> Any:
        assert self.region is not None
        return self.region.array

    def blocks_for(self, tokens: int) -> list[int]:
        return self.alloc.take(math.ceil(tokens / self.layout.tokens_per_block))

    async def send(self, request_id: str, tokens: int) -> list[int]:
        blocks = self.blocks_for(tokens)
        fill_blocks(self.pool, self.layout, blocks, request_seed(request_id))
        await self.client.send(request_id, self.pool_id, blocks, tokens)
        return blocks

    async def recv(self, request_id: str, tokens: int, peer: str) -> list[int]:
        blocks = self.blocks_for(tokens)
        clear_blocks(self.pool, self.layout, blocks)
        await self.client.recv(request_id, self.pool_id, blocks, peer, tokens)
        return blocks

    def verify(self, request_id: str, blocks: list[int], tokens: int) -> VerifyResult:
        return verify_blocks(self.pool, self.layout, blocks, request_seed(request_id), tokens)

    def verify_prefix(self, request_id: str, blocks: list[int], tokens: int) -> bool:
        """True when the first `tokens` tokens (in `blocks`) hold the request's content."""
        return self.verify(request_id, blocks, tokens).ok

    def pool_blocks(self, blocks: list[int]) -> Any:
        """The raw bytes of whole blocks (any major), for 'nothing was written here' checks."""
        if self.layout.major == "block-major":
            size = self.layout.block_bytes
            return [self.pool[b * size : (b + 1) * size] for b in blocks]
        regions = self.layout.num_layers * self.layout.kv_factor
        view = self.pool[: self.layout.pool_bytes].reshape(regions, self.layout.num_blocks, -1)
        return view[:, blocks, :]

    async def close(self, deregister: bool = True) -> None:
        """Deregister and disconnect. A refused deregistration (requests still
        active) does not raise here, so it never hides a test's own failure; the
        daemon cleans up on disconnect and assert_clean checks what is left."""
        try:
            if deregister:
                with contextlib.suppress(CallError):
                    await self.client.deregister_pool(self.pool_id)
        finally:
            await self.client.close()
            if self.region is not None:
                self.region.close()


def status(daemon: DaemonProc) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{daemon.http_address}/v1/status", timeout=10) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


def metric(daemon: DaemonProc, name: str, default: float | None = None, **labels: str) -> float:
    """One sample of the daemon's /metrics (its full name, e.g. `..._total`, and every
    label); `default` when absent (a counter nothing has incremented yet), else an error."""
    with urllib.request.urlopen(f"http://{daemon.http_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    if default is not None:
        return default
    raise AssertionError(f"no sample {name}{labels} in /metrics")


def wait_for(predicate: Callable[[], bool], timeout_s: float = 20.0, what: str = "") -> None:
    """Poll a condition with a deadline (never a bare sleep)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate}")
        time.sleep(0.02)


def assert_clean(daemon: DaemonProc) -> None:
    """No session, transfer handle, admission slot or (engine-less) pool left behind."""
    doc = status(daemon)
    assert doc["sessions"] == {"send": {}, "recv": {}}, doc["sessions"]
    assert doc["open_transfer_handles"] == 0
    assert doc["admission"]["in_flight_blocks"] == 0 and doc["admission"]["waiting"] == 0
    if doc["engines"] == 0:
        assert doc["pools"] == []

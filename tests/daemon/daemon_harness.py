"""Helpers for the daemon tests: an in-test engine built on kvxferd.client (one
tensor-parallel rank's, where a test says so), status, metric and log reads, and
deadline-bounded waits."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import json
import math
import os
import socket
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvxferd.backends import registry
from kvxferd.bench.cpu import cpu_seconds
from kvxferd.client import AsyncClient, CallError, Outcome
from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import KvLayout
from kvxferd.memory.shm import ShmRegion
from kvxferd.sim.cluster import DEFAULT_GEOMETRY, DaemonProc, LocalCluster, pool_layout
from kvxferd.sim.content import VerifyResult, clear_blocks, fill_blocks, request_seed, verify_blocks
from kvxferd.sim.workload import BlockAllocator

_SIOCGIFFLAGS, _SIOCGIFADDR, _IFF_UP, _IFF_LOOPBACK = 0x8913, 0x8915, 0x1, 0x8


def network_device() -> str | None:
    """A network device that is up, not loopback, and has an IPv4 address (for UCX over
    TCP within this host), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            req = name.encode()[:15].ljust(40, b"\0")
            try:
                flags = int.from_bytes(fcntl.ioctl(sock, _SIOCGIFFLAGS, req)[16:18], "little")
                fcntl.ioctl(sock, _SIOCGIFADDR, req)  # OSError: no IPv4 address
            except OSError:
                continue
            if flags & _IFF_UP and not flags & _IFF_LOOPBACK:
                return name
    return None


def ucx_over_tcp(monkeypatch: pytest.MonkeyPatch) -> str:
    """Daemons started from now on run UCX (under NIXL, UCX or MPI) over its TCP alone, on
    a network device of this host (UCX's TCP does not start over loopback here). Returns
    the transport used ("tcp", or "shm" when this host has no such device)."""
    device = network_device()
    if device is None:
        return "shm"
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", device)
    return "tcp"


def mpi_over_tcp(monkeypatch: pytest.MonkeyPatch) -> str:
    """Daemons started from now on run MPI over UCX's TCP alone (one connection per peer):
    the configuration that keeps a peer stopped inside a send from holding up other peers'
    receives (docs/backends-mpi.md). Returns the transport used (ucx_over_tcp)."""
    return ucx_over_tcp(monkeypatch)


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


# Small (layer, K/V) pieces: 32 tokens x 1 head x 16 dims x fp16 = 1 KiB, so a layer-major
# request is many small segments: what the bounce buffer is for.
SMALL_PIECES: dict[str, Any] = {
    "num_layers": 8,
    "num_kv_heads": 1,
    "head_dim": 16,
    "tokens_per_block": 32,
    "dtype": "float16",
    "layout": "layer-major",
}


def layout_for(
    major: str, num_blocks: int = 128, geometry: dict[str, Any] | None = None
) -> KvLayout:
    return pool_layout(
        {**(GEOMETRY if geometry is None else geometry), "layout": major}, num_blocks
    )


E = TypeVar("E", bound="SimEngine")


class SimEngine:
    """A reference engine driven step by step from a test; with `tp`, one rank of a
    tensor-parallel group, whose pool holds that rank's heads."""

    tp: TpRank = TpRank()

    def __init__(self, client: AsyncClient, layout: KvLayout, pool_id: str) -> None:
        self.client = client
        self.layout = layout
        self.pool_id = pool_id
        self.region: ShmRegion | None = None
        self.alloc = BlockAllocator(layout.num_blocks)

    @classmethod
    async def open(
        cls: type[E],
        daemon: DaemonProc,
        major: str = "block-major",
        num_blocks: int = 128,
        pool_id: str = "pool0",
        geometry: dict[str, Any] | None = None,
        tp: TpRank | None = None,
        fill_with: int | None = None,
    ) -> E:
        """`geometry`: the pool's own (a rank's heads only, with `tp`); `fill_with`: a
        byte the whole pool holds before it is registered."""
        client = await AsyncClient.connect(daemon.api_socket, engine=f"test-{daemon.name}")
        engine = cls(client, layout_for(major, num_blocks, geometry), pool_id)
        name = f"kvxferd-test-{pool_id}-{os.getpid()}-{id(engine)}"
        engine.region = ShmRegion.create(name, engine.layout.pool_bytes)
        if fill_with is not None:
            engine.pool[:] = fill_with
        try:
            if tp is None:
                await client.register_pool(pool_id, name, engine.layout)
            else:
                engine.tp = tp
                await client.register_pool(pool_id, name, engine.layout, tp.rank, tp.size)
        finally:
            engine.region.unlink()
        return engine

    @property
    def pool(self) -> Any:
        assert self.region is not None
        return self.region.array

    def blocks_for(self, tokens: int) -> list[int]:
        return self.alloc.take(math.ceil(tokens / self.layout.tokens_per_block))

    def fill(self, request_id: str, tokens: int) -> list[int]:
        """Blocks for `tokens`, holding the request's reference content."""
        blocks = self.blocks_for(tokens)
        fill_blocks(self.pool, self.layout, blocks, request_seed(request_id), tp=self.tp)
        return blocks

    async def send(self, request_id: str, tokens: int) -> list[int]:
        blocks = self.fill(request_id, tokens)
        await self.client.send(request_id, self.pool_id, blocks, tokens)
        return blocks

    async def recv(self, request_id: str, tokens: int, peer: str | list[str]) -> list[int]:
        blocks = self.blocks_for(tokens)
        clear_blocks(self.pool, self.layout, blocks)
        await self.client.recv(request_id, self.pool_id, blocks, peer, tokens)
        return blocks

    def verify(self, request_id: str, blocks: list[int], tokens: int) -> VerifyResult:
        seed = request_seed(request_id)
        return verify_blocks(self.pool, self.layout, blocks, seed, tokens, tp=self.tp)

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


def start_pair(cluster: LocalCluster, **cfg: Any) -> tuple[DaemonProc, DaemonProc]:
    """A context daemon "ctx", then a generation daemon "gen", both started with `cfg`."""
    ctx = cluster.start_daemon("ctx", "context", **cfg)
    return ctx, cluster.start_daemon("gen", "generation", **cfg)


def start_on_a_busy_peer_port(cluster: LocalCluster) -> tuple[DaemonProc, int]:
    """A context daemon told to listen for peers on a port something else listens on:
    it exits with status 1. Returns it, and that port."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = int(busy.getsockname()[1])
        d = cluster.start_daemon(
            "ctx", "context", wait=False, daemon={"peer_listen": f"127.0.0.1:{port}"}
        )
        assert d.proc.wait(60) == 1
    return d, port


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


def assert_clean(*daemons: DaemonProc) -> None:
    """No session, transfer handle, admission slot or (engine-less) pool left behind."""
    for daemon in daemons:
        doc = status(daemon)
        assert doc["sessions"] == {"send": {}, "recv": {}}, doc["sessions"]
        assert doc["open_transfer_handles"] == 0
        assert doc["admission"]["in_flight_blocks"] == 0 and doc["admission"]["waiting"] == 0
        if doc["engines"] == 0:
            assert doc["pools"] == []


def core_share(daemon: DaemonProc, seconds: float = 0.5) -> float:
    """The share of one core the daemon used over `seconds` (utime + stime, /proc): what
    tells a survivor still spinning on something its dead peer left behind."""
    before, t0 = cpu_seconds(daemon.proc.pid), time.monotonic()
    time.sleep(seconds)
    after, t1 = cpu_seconds(daemon.proc.pid), time.monotonic()
    assert before is not None and after is not None, f"{daemon.name} is gone"
    return (after - before) / (t1 - t0)


async def until(predicate: Callable[[], bool], timeout_s: float = 20.0, what: str = "") -> None:
    """wait_for (a deadline-bounded poll) off the event loop, so outcomes keep arriving."""
    await asyncio.to_thread(wait_for, predicate, timeout_s, what)


@contextlib.asynccontextmanager
async def opened(
    daemon: DaemonProc, using: Callable[..., Awaitable[Any]] | None = None, **kw: Any
) -> AsyncIterator[Any]:
    """A SimEngine for the scope (made by `using`, a subclass's opener, if given). Closed
    (and its pool deregistered while the daemon lives) on the way out; after a failure,
    cleanup errors do not hide the failure."""
    engine = await (using or SimEngine.open)(daemon, **kw)
    try:
        yield engine
    except BaseException:
        with contextlib.suppress(Exception):
            await engine.close(deregister=False)
        raise
    await engine.close(deregister=daemon.alive())


def with_engines(
    ctx: DaemonProc,
    gen: DaemonProc,
    scenario: Callable[[SimEngine, SimEngine], Awaitable[None]],
    **kw: Any,
) -> None:
    """Run `scenario(c, g)` with an engine on each daemon (both opened with `kw`, as
    `opened` does), then check that neither daemon has anything left behind."""

    async def main() -> None:
        async with opened(ctx, **kw) as c, opened(gen, **kw) as g:
            await scenario(c, g)

    asyncio.run(main())
    assert_clean(ctx, gen)


async def wait_all(client: AsyncClient, rids: list[str], by: float) -> dict[str, Outcome]:
    """Every request's outcome, all of them before the monotonic time `by`."""
    out: dict[str, Outcome] = {}
    for rid in rids:
        try:
            out[rid] = await client.wait(rid, timeout_s=max(0.05, by - time.monotonic()))
        except asyncio.TimeoutError:
            raise AssertionError(
                f"{rid}: no outcome within its deadline; got {sorted(out)} so far"
            ) from None
    return out


async def delivered(
    c: SimEngine, g: SimEngine, rid: str, blocks: list[int], tokens: int, timeout_s: float = 30
) -> tuple[Outcome, Outcome]:
    """Both sides done, the request's content verified in `blocks`; both released.
    Returns both outcomes, received and sent."""
    got = await g.client.wait(rid, timeout_s=timeout_s)
    sent = await c.client.wait(rid, timeout_s=timeout_s)
    assert (got.status, got.reason) == ("done", "ok"), got
    assert (sent.status, sent.reason) == ("done", "ok"), sent
    result = g.verify(rid, blocks, tokens)
    assert result.ok and result.bytes_checked > 0, result.first_mismatch
    await g.client.release(rid)
    await c.client.release(rid)
    return got, sent


async def move_each(
    ctx: DaemonProc,
    c: SimEngine,
    g: SimEngine,
    requests: list[tuple[str, int]],
    concurrent: bool = False,
    timeout_s: float = 60,
) -> None:
    """Each (request id, tokens) received by `g`, sent by `c` and delivered, with as many
    bytes on both sides; one after the other, or all at once if `concurrent`."""

    async def one(rid: str, tokens: int) -> None:
        blocks = await g.recv(rid, tokens, ctx.peer_address)
        await c.send(rid, tokens)
        got, sent = await delivered(c, g, rid, blocks, tokens, timeout_s)
        assert sent.nbytes == got.nbytes, (got, sent)

    if concurrent:
        await asyncio.gather(*(one(rid, n) for rid, n in requests))
    else:
        for rid, n in requests:
            await one(rid, n)


async def transfer_one(ctx: DaemonProc, c: SimEngine, g: SimEngine, rid: str, tokens: int) -> None:
    """One request end to end; both sides done and every byte verified; both released."""
    blocks = await g.recv(rid, tokens, ctx.peer_address)
    await c.send(rid, tokens)
    await delivered(c, g, rid, blocks, tokens)


async def serve_then_hold(
    ctx: DaemonProc, c: SimEngine, g: SimEngine, served: str, held: str
) -> None:
    """One request (`served`) moved end to end, then one (`held`) received that the
    context daemon holds, its engine never sending it."""
    await transfer_one(ctx, c, g, served, 100)
    await g.recv(held, 100, ctx.peer_address)
    await until(lambda: status(ctx)["sessions"]["send"] == {"ready": 1}, what=f"{held} at ctx")


async def serve_once(ctx: DaemonProc, gen: DaemonProc, rid: str, tokens: int = 100) -> None:
    """A fresh engine on each side moves one request: the pair is healthy."""
    async with opened(ctx, pool_id=f"p-{rid}") as c, opened(gen, pool_id=f"p-{rid}") as g:
        await transfer_one(ctx, c, g, rid, tokens)


def healthy(daemon: DaemonProc) -> bool:
    """The daemon is alive and its /healthz answers 200."""
    url = f"http://{daemon.http_address}/healthz"
    with urllib.request.urlopen(url, timeout=10) as resp:
        return daemon.alive() and resp.status == 200


def peer_names(daemon: DaemonProc) -> list[str]:
    return sorted(p["name"] for p in status(daemon)["peers"])


def log_lines(daemon: DaemonProc, *words: str) -> list[str]:
    """Lines of the daemon's log that contain every one of `words`."""
    return [line for line in daemon.log_text().splitlines() if all(w in line for w in words)]


def logged(daemon: DaemonProc, *words: str, count: int = 1, timeout_s: float = 5.0) -> list[str]:
    """Wait until the daemon's log has `count` lines holding every one of `words`."""
    try:
        wait_for(lambda: len(log_lines(daemon, *words)) >= count, timeout_s)
    except AssertionError:
        raise AssertionError(
            f"{daemon.name} logged no line with {words}:\n{daemon.log_text()[-3000:]}"
        ) from None
    return log_lines(daemon, *words)


def blocks_untouched(engine: SimEngine, blocks: list[int]) -> bool:
    """Every byte of these (block-major) blocks is still zero."""
    bb = engine.layout.block_bytes
    return all(not engine.pool[b * bb : (b + 1) * bb].any() for b in blocks)


def restart_daemon(cluster: LocalCluster, old: DaemonProc, **kw: Any) -> DaemonProc:
    """Start a new daemon under the name and role of `old`: a restarted peer (same name,
    new incarnation). If `old` still runs (hung), give the new one its own api_socket."""
    return cluster.start_daemon(old.name, old.role, **kw)

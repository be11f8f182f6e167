"""The vLLM connector's worker side (transfers.Transfers) against real daemons, without vLLM.

Each `Worker` is what KvxferdConnector's worker instance is: a KV pool in a sealed memfd
registered with its daemon, and a `Transfers` that vLLM drives once a step with that step's
plan (`post`, in start_load_kv) and the step's `finished_req_ids` (`collect`, in
get_transfer_results). Plans come from a real `Planner`, as vLLM's scheduler makes them.

vLLM's rules, checked on everything each test's workers report: an id is reported once,
ever (a second report crashes the scheduler); a failed load is in finished_recving and
failed_recving the same step; a send is reported only in or after the step whose
finished_req_ids named its request (before, vLLM would free the blocks of a running request).
Two `kvxferd run` daemons (NIXL on loopback) serve the module; the test that kills and
restarts them runs last.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nixl_harness import nixl_or_skip

from kvxferd.client import Client
from kvxferd.integrations.vllm import transfers as transfers_module
from kvxferd.integrations.vllm.plan import Planner, Refusal, StepPlan
from kvxferd.integrations.vllm.transfers import Results, Transfers
from kvxferd.memory.memfd import MemfdRegion
from kvxferd.sim.cluster import DaemonProc, LocalCluster, pool_layout

nixl_or_skip("the daemons need NIXL (scripts/install.sh)")

# Small blocks (2 layers x K, V x 16 tokens x 2 heads x 16 dims x fp16 = 4 KiB): the bytes
# are checked, not the bandwidth.
GEOMETRY: dict[str, Any] = {
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "tokens_per_block": 16,
    "dtype": "float16",
    "layout": "block-major",
}
BS: int = GEOMETRY["tokens_per_block"]
POOL_BLOCKS = 64
SENTINEL = 0xA5  # what every block holds that no transfer may write
TIMEOUT_S = 20.0
TRANSCEIVER = {"kv_transfer_timeout_ms": 15000}


class Daemons:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.ctx = self.start("ctx", "context")
        self.gen = self.start("gen", "generation")

    def start(self, name: str, role: str) -> DaemonProc:
        return self.cluster.start_daemon(name, role, transceiver=TRANSCEIVER)


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    with LocalCluster(tmp_path_factory.mktemp("vllm-transfers"), geometry=GEOMETRY) as c:
        d = Daemons(c)
        yield d
        # The daemons serving at the end (the kill test restarts both) drain cleanly; one a
        # failed test left dead is that test's failure, not this one.
        live = [x for x in (d.ctx, d.gen) if x.alive()]
        codes = {x.name: x.stop() for x in live}
        assert codes == {x.name: 0 for x in live}, [x.log_text()[-2000:] for x in live]


def status(daemon: DaemonProc) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{daemon.http_address}/v1/status", timeout=10) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


def no_sessions(daemon: DaemonProc) -> None:
    assert status(daemon)["sessions"] == {"send": {}, "recv": {}}


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


class Worker:
    """One vLLM worker: its pool, its Transfers, and everything they reported."""

    def __init__(self, daemon: DaemonProc, name: str, *, pool_id: str = "") -> None:
        self.daemon = daemon
        self.name = name
        self.layout = pool_layout(GEOMETRY, POOL_BLOCKS)
        self.region = MemfdRegion.create(self.layout.pool_bytes, f"vllm-test-{name}")
        self.region.array[: self.layout.pool_bytes] = SENTINEL
        self.registered = f"{name}-kv"
        self.dialed: list[Client] = []
        self.records: list[dict[str, object]] = []
        self.steps: list[Results] = []
        # A pool id other than the registered one: every call names a pool the daemon lacks.
        self.transfers = Transfers(
            self.connect,
            pool_id or self.registered,
            client=self.connect(),
            idle_wait_s=0.005,
            record=self.records.append,
        )

    def connect(self) -> Client:
        """What the connector's _redial does: dial, and register the same memory again."""
        client = Client(self.daemon.api_socket, engine=f"vllm-test-{self.name}")
        try:
            client.register_pool(self.registered, self.region, self.layout)
        except BaseException:
            client.close()
            raise
        self.dialed.append(client)
        return client

    # ------------------------------------------------------------------ memory

    def block(self, b: int) -> np.ndarray:
        size = self.layout.block_bytes
        return self.region.array[b * size : (b + 1) * size]

    def fill(self, blocks: Iterable[int], seed: int) -> None:
        rng = np.random.default_rng(seed)
        for b in blocks:
            self.block(b)[:] = rng.integers(0, 256, self.layout.block_bytes, dtype=np.uint8)

    def clear(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.block(b)[:] = 0

    def holds_copy_of(self, other: Worker, mine: Iterable[int], theirs: Iterable[int]) -> None:
        """Each of our blocks `mine` holds the bytes of `other`'s block at the same place in
        `theirs`."""
        for db, pb in zip(mine, theirs, strict=True):
            assert np.array_equal(self.block(db), other.block(pb)), (db, pb)

    def untouched(self, written: Iterable[int]) -> None:
        """Every block but `written` still holds nothing but SENTINEL bytes."""
        others = sorted(set(range(POOL_BLOCKS)) - set(written))
        bad = [b for b in others if not np.all(self.block(b) == SENTINEL)]
        assert not bad, f"{self.name}: blocks written that no transfer was given: {bad}"

    # --------------------------------------------------------------- stepping

    def step(self, plan: StepPlan | None = None, finished: Iterable[str] = ()) -> Results:
        """One vLLM step: start_load_kv (post), then get_transfer_results (collect)."""
        plan = plan if plan is not None else StepPlan(idle=True)
        self.transfers.post(plan)
        got = self.transfers.collect(set(finished), idle=plan.idle)
        assert got.failed <= got.recving, f"{self.name}: failed loads not in finished_recving"
        self.steps.append(got)
        self.check_once()
        return got

    def count(self, what: str, req_id: str) -> int:
        return sum(req_id in getattr(r, what) for r in self.steps)

    def reported(self, what: str) -> Counter[str]:
        return Counter(i for r in self.steps for i in getattr(r, what))

    def check_once(self) -> None:
        for what in ("sending", "recving", "failed"):
            twice = {i: n for i, n in self.reported(what).items() if n > 1}
            assert not twice, f"{self.name}: reported more than once in {what}: {twice}"

    def close(self) -> None:
        self.transfers.close()
        self.region.close()


@pytest.fixture
def workers(daemons: Daemons) -> Iterator[Callable[..., Worker]]:
    made: list[Worker] = []

    def make(daemon: DaemonProc, name: str, **kw: Any) -> Worker:
        w = Worker(daemon, name, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def run_until(what: str, done: Callable[[], bool], *workers: Worker) -> int:
    """Step every worker (nothing new planned, nothing finished) until `done`; the steps."""
    deadline = time.monotonic() + TIMEOUT_S
    n = 0
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        for w in workers:
            w.step()
        n += 1
    return n


def both_reported(
    what: str, d: Worker, d_req: str, p: Worker, p_req: str, *, then_steps: int
) -> None:
    """Step both workers until `d` reported `d_req` received and `p` reported `p_req` sent,
    then `then_steps` more steps each (nothing planned): any report twice would show."""
    run_until(what, lambda: d.count("recving", d_req) > 0 and p.count("sending", p_req) > 0, d, p)
    for _ in range(then_steps):
        d.step()
        p.step()


def recv_params(tid: str, peer: str) -> dict[str, Any]:
    return {"do_remote_prefill": True, "kvxferd": {"transfer_id": tid, "peer": peer}}


def send_params(tid: str) -> dict[str, Any]:
    return {"do_remote_decode": True, "kvxferd": {"transfer_id": tid}}


def plan_recv(
    req_id: str, tid: str, peer: str, prompt: int, blocks: list[int], local_hit: int = 0
) -> StepPlan:
    """What the decode scheduler plans for a request vLLM just allocated `blocks` for."""
    planner = Planner(BS, consumer=True, producer=False)
    params = recv_params(tid, peer)
    n = planner.matched_tokens(req_id, params, prompt, local_hit)
    assert n == prompt - local_hit
    planner.after_alloc(req_id, params, prompt, blocks, n, "")
    plan = planner.take(0)
    assert len(plan.recvs) == 1 and not plan.refusals, plan
    return plan


def plan_send(req_id: str, tid: str, prompt: int, blocks: list[int]) -> StepPlan:
    """What the prefill scheduler plans when the request's prompt is done."""
    planner = Planner(BS, consumer=False, producer=True)
    keep, reply = planner.finished(req_id, send_params(tid), True, prompt, blocks)
    assert keep and reply is not None and reply["kvxferd"]["transfer_id"] == tid
    plan = planner.take(0)
    assert len(plan.sends) == 1, plan
    return plan


def outcome_arrived(w: Worker, req_id: str) -> bool:
    # White-box: the send's outcome reached the Transfers (only vLLM's finished_req_ids
    # still holds its report back).
    entry = w.transfers._entries.get(req_id)
    return entry is not None and entry.outcome is not None


# ------------------------------------------------------------------------ the tests


def test_a_transfer_is_reported_once_on_each_side_and_the_send_after_finished(
    daemons: Daemons, workers: Callable[..., Worker]
) -> None:
    d = workers(daemons.gen, "decode")
    p = workers(daemons.ctx, "prefill")
    prompt = 100  # 7 blocks, the last partial
    p_blocks = [12, 3, 40, 7, 8, 21, 30]
    d_blocks = [5, 9, 33, 2, 60, 61, 17, 18]  # one more than the prompt's: decode growth
    p.fill(p_blocks, seed=1)
    d.clear(d_blocks[:7])

    d.step(plan_recv("d-1", "t-1", daemons.ctx.peer_address, prompt, d_blocks))
    # vLLM names the request in finished_req_ids with the plan; here it is held back.
    p.step(plan_send("p-1", "t-1", prompt, p_blocks))

    run_until("the receive", lambda: d.count("recving", "d-1") > 0, d, p)
    assert d.count("failed", "d-1") == 0
    run_until("the send's outcome", lambda: outcome_arrived(p, "p-1"), d, p)
    for _ in range(5):
        assert not p.step().sending
    assert p.count("sending", "p-1") == 0 and p.transfers.pending == 1

    got = p.step(finished={"p-1"})
    assert got.sending == {"p-1"} and not got.recving and not got.failed
    # The decode request finishing later is none of the connector's business any more.
    d.step(finished={"d-1"})
    for _ in range(5):
        d.step()
        p.step()

    assert d.reported("recving") == {"d-1": 1} and not d.reported("failed")
    assert d.reported("sending") == Counter()
    assert p.reported("sending") == {"p-1": 1} and not p.reported("recving")
    assert d.transfers.pending == p.transfers.pending == 0

    d.holds_copy_of(p, d_blocks[:7], p_blocks)
    d.untouched(d_blocks[:7])
    (rec,) = d.records
    assert rec["status"] == "done" and rec["nbytes"] == 7 * d.layout.block_bytes, rec
    assert p.records[0]["status"] == "done"
    no_sessions(daemons.gen)
    no_sessions(daemons.ctx)


def test_a_receive_from_block_start_k_moves_only_blocks_k_on(
    daemons: Daemons, workers: Callable[..., Worker]
) -> None:
    d = workers(daemons.gen, "decode")
    p = workers(daemons.ctx, "prefill")
    prompt, k = 150, 3  # 10 blocks, the first 3 a local prefix-cache hit
    p_blocks = list(range(20, 30))
    cached, fresh = [1, 2, 3], [44, 45, 50, 51, 52, 53, 9]
    p.fill(p_blocks, seed=2)
    d.clear(fresh)

    plan = plan_recv("d-k", "t-k", daemons.ctx.peer_address, prompt, cached + fresh, k * BS)
    (recv,) = plan.recvs
    assert recv.block_start == k and recv.blocks == tuple(fresh)
    d.step(plan)
    p.step(plan_send("p-k", "t-k", prompt, p_blocks), finished={"p-k"})  # as vLLM does
    run_until(
        "both sides",
        lambda: d.count("recving", "d-k") > 0 and p.count("sending", "p-k") > 0,
        d,
        p,
    )

    assert d.reported("recving") == {"d-k": 1} and not d.reported("failed")
    assert p.reported("sending") == {"p-k": 1}
    d.holds_copy_of(p, fresh, p_blocks[k:])
    d.untouched(fresh)  # the cached blocks above all
    assert d.records[0]["nbytes"] == len(fresh) * d.layout.block_bytes


def test_a_receive_aborted_before_any_send_is_cancelled_and_reported_once(
    daemons: Daemons, workers: Callable[..., Worker]
) -> None:
    d = workers(daemons.gen, "decode")
    blocks = [4, 5, 6]
    d.clear(blocks)
    d.step(plan_recv("d-ab", "t-ab", daemons.ctx.peer_address, 40, blocks))
    for _ in range(3):
        assert d.step() == Results(set(), set(), set())

    # The client went away: vLLM finishes the request while its receive is posted.
    d.step(finished={"d-ab"})
    run_until("the cancelled receive", lambda: d.count("recving", "d-ab") > 0, d)
    for _ in range(5):
        d.step()

    assert d.reported("recving") == {"d-ab": 1} and d.reported("failed") == {"d-ab": 1}
    (rec,) = d.records
    assert rec["status"] == "cancelled" and rec["aborted"] is True, rec
    assert d.transfers.pending == 0
    no_sessions(daemons.gen)
    d.untouched(blocks)
    assert all(not d.block(b).any() for b in blocks)


def test_refusals_in_the_plan_are_failed_loads_reported_once(
    daemons: Daemons, workers: Callable[..., Worker]
) -> None:
    d = workers(daemons.gen, "decode")
    planner = Planner(BS, consumer=True, producer=False)
    malformed = {"do_remote_prefill": True, "kvxferd": {"transfer_id": "no spaces allowed"}}
    no_peer = {"do_remote_prefill": True, "kvxferd": {"transfer_id": "t-np"}}
    for req_id, params in (("d-bad", malformed), ("d-nopeer", no_peer)):
        n = planner.matched_tokens(req_id, params, 32, 0)
        planner.after_alloc(req_id, params, 32, [1, 2], n, "")
    planner.refuse("d-raised", "planning raised")
    plan = planner.take(0)
    assert {r.req_id for r in plan.refusals} == {"d-bad", "d-nopeer", "d-raised"}
    plan.refusals.append(Refusal("d-direct", "a refusal as the metadata carries it"))

    got = d.step(plan)
    want = {"d-bad", "d-nopeer", "d-raised", "d-direct"}
    assert got.recving == want and got.failed == want and not got.sending
    for _ in range(5):
        d.step(planner.take(0))
    d.step(finished=want)
    assert d.reported("recving") == dict.fromkeys(want, 1)
    assert d.reported("failed") == dict.fromkeys(want, 1)
    assert d.transfers.pending == 0 and not d.records  # nothing reached the daemon
    no_sessions(daemons.gen)


def test_calls_the_daemon_refuses_fail_once_and_raise_nothing(
    daemons: Daemons, workers: Callable[..., Worker]
) -> None:
    peer = daemons.ctx.peer_address
    # A pool id the daemon never registered, on both sides.
    d_lost = workers(daemons.gen, "decode-nopool", pool_id="not-registered")
    p_lost = workers(daemons.ctx, "prefill-nopool", pool_id="not-registered")
    # The call is started, not waited for: its refusal fails it in this step or a later one.
    d_lost.step(plan_recv("d-np", "t-np", peer, 32, [1, 2]))
    run_until("the refused receive", lambda: d_lost.count("recving", "d-np") > 0, d_lost)
    (at,) = [r for r in d_lost.steps if "d-np" in r.recving]
    assert at.failed == {"d-np"}, at  # in failed_recving in the same step
    assert d_lost.records[0]["status"] == "not_posted"
    # A refused send is still a send: reported once, and not before vLLM finished it.
    assert not p_lost.step(plan_send("p-np", "t-np", 32, [1, 2])).sending
    for _ in range(3):
        assert not p_lost.step().sending
    run_until("the refusal of the send", lambda: p_lost.transfers._entries["p-np"].failed, p_lost)
    assert not p_lost.reported("sending")  # white-box above: failed, held until finished
    got = p_lost.step(finished={"p-np"})
    assert got.sending == {"p-np"}

    # One transfer id twice: the second call is refused, the first goes on unharmed.
    d = workers(daemons.gen, "decode")
    p = workers(daemons.ctx, "prefill")
    p.fill([10, 11, 12], seed=3)
    d.clear([1, 2, 3])  # [4, 5, 6], the refused receive's, keep their SENTINEL
    first = plan_recv("d-a", "t-dup", peer, 40, [1, 2, 3])
    second = plan_recv("d-b", "t-dup", peer, 40, [4, 5, 6])
    d.step(StepPlan(recvs=first.recvs + second.recvs))
    # Refused by the client itself (the id is taken), in this step or a later one.
    run_until("the refused duplicate", lambda: d.count("recving", "d-b") > 0, d)
    (at,) = [r for r in d.steps if "d-b" in r.recving]
    assert at.failed == {"d-b"}, at
    sends = plan_send("p-a", "t-dup", 40, [10, 11, 12]).sends
    sends += plan_send("p-b", "t-dup", 40, [13, 14, 15]).sends
    p.step(StepPlan(sends=sends), finished={"p-a", "p-b"})
    both_reported("the first transfer", d, "d-a", p, "p-a", then_steps=5)

    assert d.reported("recving") == {"d-a": 1, "d-b": 1} and d.reported("failed") == {"d-b": 1}
    assert p.reported("sending") == {"p-a": 1, "p-b": 1}
    for w in (d_lost, p_lost, d, p):
        assert w.transfers.pending == 0, w.name
    d.holds_copy_of(p, [1, 2, 3], [10, 11, 12])
    d.untouched([1, 2, 3])  # the refused receive's blocks too
    assert {r["status"] for r in p.records} == {"done", "not_posted"}
    no_sessions(daemons.gen)
    no_sessions(daemons.ctx)


def test_a_stopped_daemon_does_not_hold_the_step_back(
    daemons: Daemons, workers: Callable[..., Worker]
) -> None:
    """post (vLLM's start_load_kv, before the forward pass) starts its calls and does not
    wait for the daemon's answers: with the generation daemon stopped (SIGSTOP) the step
    returns with the receive pending, not failed by the client's timeout; once the daemon
    runs again the transfer completes as usual."""
    d = workers(daemons.gen, "decode")
    p = workers(daemons.ctx, "prefill")
    p.fill([50, 51], seed=5)
    d.clear([20, 21])
    daemons.gen.kill(signal.SIGSTOP)
    try:
        got = d.step(plan_recv("d-s", "t-s", daemons.ctx.peer_address, 20, [20, 21]))
        assert got == Results(set(), set(), set()), got
        assert d.transfers.pending == 1 and not d.records
        assert not d.dialed[-1].gone
    finally:
        daemons.gen.kill(signal.SIGCONT)
    p.step(plan_send("p-s", "t-s", 20, [50, 51]), finished={"p-s"})
    both_reported("the transfer after SIGCONT", d, "d-s", p, "p-s", then_steps=3)
    assert not d.reported("failed") and len(d.dialed) == 1
    d.holds_copy_of(p, [20, 21], [50, 51])
    d.untouched([20, 21])
    no_sessions(daemons.gen)
    no_sessions(daemons.ctx)


def test_an_abort_while_the_daemon_is_stopped_neither_blocks_nor_reports_early(
    daemons: Daemons, workers: Callable[..., Worker]
) -> None:
    """vLLM aborts a posted receive while the generation daemon is stopped (SIGSTOP): the
    step asks for the cancel without waiting for the answer (a blocking cancel would stop
    vLLM's loop until SIGCONT), and reports nothing meanwhile: the context daemon, which
    knows the receive, still writes into its blocks. After SIGCONT it is reported once."""
    d = workers(daemons.gen, "decode")
    p = workers(daemons.ctx, "prefill")
    p.fill([40, 41], seed=6)
    d.clear([10, 11])
    d.step(plan_recv("d-c", "t-c", daemons.ctx.peer_address, 20, [10, 11]))
    wait_for(
        "the context daemon to know the receive",
        lambda: status(daemons.ctx)["sessions"]["send"] == {"ready": 1},
    )
    daemons.gen.kill(signal.SIGSTOP)
    stepping = threading.Thread(target=lambda: d.step(finished={"d-c"}), daemon=True)
    try:
        stepping.start()
        stepping.join(TIMEOUT_S)
        assert not stepping.is_alive(), "the step waited for the stopped daemon's answer"
        # The writer goes on while the generation daemon is stopped: the bytes land.
        p.step(plan_send("p-c", "t-c", 20, [40, 41]), finished={"p-c"})
        run_until("the send's report", lambda: p.count("sending", "p-c") > 0, p)
        for _ in range(5):
            assert d.step() == Results(set(), set(), set())
        assert d.transfers.pending == 1 and not d.records
    finally:
        daemons.gen.kill(signal.SIGCONT)
        stepping.join(TIMEOUT_S)
    run_until("the aborted receive's report", lambda: d.count("recving", "d-c") > 0, d)
    for _ in range(5):
        d.step()
    assert d.reported("recving") == {"d-c": 1}
    (rec,) = d.records
    assert rec["aborted"] is True and rec["status"] in ("done", "cancelled"), rec
    if rec["status"] == "done":
        assert not d.reported("failed")
        d.holds_copy_of(p, [10, 11], [40, 41])
    d.untouched([10, 11])
    no_sessions(daemons.gen)
    no_sessions(daemons.ctx)


def test_calls_slow_to_leave_a_starved_client_fail_nothing(
    daemons: Daemons, workers: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's thread cannot run (a starved process) past the post's flush timeout:
    that is not a lost daemon. The step goes on, the calls leave once the thread runs,
    and the transfer completes on the same connection (it once failed every transfer in
    flight, and dropped the connection, with their blocks maybe still being written)."""
    monkeypatch.setattr(transfers_module, "_FLUSH_S", 0.2)
    d = workers(daemons.gen, "decode")
    p = workers(daemons.ctx, "prefill")
    client = d.dialed[-1]
    stuck = threading.Event()
    client._loop.call_soon_threadsafe(stuck.wait, TIMEOUT_S)  # white-box: the starvation
    try:
        got = d.step(plan_recv("d-s", "t-s", daemons.ctx.peer_address, 40, [1, 2, 3]))
        assert not got.recving and not got.failed, got
        assert d.transfers._client is client and d.transfers.pending == 1
        assert not client.gone
    finally:
        stuck.set()
    p.fill([4, 5, 6], seed=7)
    d.clear([1, 2, 3])
    p.step(plan_send("p-s", "t-s", 40, [4, 5, 6]), finished={"p-s"})
    both_reported("the transfer", d, "d-s", p, "p-s", then_steps=3)
    assert not d.reported("failed") and len(d.dialed) == 1
    d.holds_copy_of(p, [1, 2, 3], [4, 5, 6])
    d.untouched([1, 2, 3])


# Its own daemons: short deadlines, so that a stopped writer fails the receive in ~2 s
# (the module's have 15 s), and a stopped daemon the module's other tests never see.
FENCING: dict[str, Any] = {
    "transceiver": {"kv_transfer_timeout_ms": 2000},
    "daemon": {"heartbeat_interval_ms": 300, "heartbeat_timeout_ms": 1500},
}


@contextlib.contextmanager
def fencing_pair(tmp_path: Path) -> Iterator[tuple[DaemonProc, DaemonProc, Worker, Worker]]:
    """Two daemons of their own with FENCING's deadlines and a worker on each (the prefill
    one's pool registered, its send never planned); the workers closed after, and the
    daemons still alive then stopped, each exiting 0."""
    with LocalCluster(tmp_path, geometry=GEOMETRY) as cluster:
        ctx = cluster.start_daemon("ctx", "context", **FENCING)
        gen = cluster.start_daemon("gen", "generation", **FENCING)
        d = Worker(gen, "decode")
        p = Worker(ctx, "prefill")
        try:
            yield ctx, gen, d, p
        finally:
            d.close()
            p.close()
        live = [x for x in (ctx, gen) if x.alive()]
        codes = {x.name: x.stop() for x in live}
        assert codes == {x.name: 0 for x in live}, [x.log_text()[-2000:] for x in live]


def post_known_to_its_writer(
    d: Worker, ctx: DaemonProc, req_id: str, tid: str, blocks: list[int]
) -> None:
    """A receive into `blocks` (cleared) posted on `d`, and known to the context daemon,
    which waits for a send that is never planned."""
    d.clear(blocks)
    d.step(plan_recv(req_id, tid, ctx.peer_address, 40, blocks))
    wait_for(
        "the context daemon to know the request",
        lambda: status(ctx)["sessions"]["send"] == {"ready": 1},
    )


def test_a_receive_failed_with_blocks_held_is_reported_only_once_released(
    tmp_path: Path,
) -> None:
    """The writer (the context daemon) is stopped once it knows the request: the receive
    fails at its deadline (or the heartbeat timeout) with blocks_held, since nothing proves
    that the stopped process will not write. vLLM must not hear of it (it would reuse the
    blocks) until the daemon's `released`; after SIGCONT the writer's AbortAck releases it,
    and it is reported once, in finished_recving and failed_recving in the same step."""
    with fencing_pair(tmp_path) as (ctx, gen, d, _prefill):
        blocks = [7, 8, 9]
        post_known_to_its_writer(d, ctx, "d-h", "t-h", blocks)
        ctx.kill(signal.SIGSTOP)
        try:
            run_until(
                "the failed receive's outcome",
                lambda: outcome_arrived(d, "d-h") or d.count("recving", "d-h") > 0,
                d,
            )
            assert d.count("recving", "d-h") == 0, "reported while its blocks are held"
            outcome = d.transfers._entries["d-h"].outcome  # white-box, as outcome_arrived
            assert outcome is not None and outcome.status in ("failed", "timed_out"), outcome
            assert outcome.blocks_held, outcome
            # Held while the writer stays stopped: step for a while, nothing reported.
            held_until = time.monotonic() + 1.0
            steps = 0
            while time.monotonic() < held_until or steps < 10:
                got = d.step()
                assert "d-h" not in got.recving and "d-h" not in got.failed, got
                assert d.dialed[-1].released("t-h") is None
                steps += 1
                assert steps < 10_000, "the held phase never ended"
            assert d.transfers.pending == 1 and not d.records
            holds = status(gen)["holds"]
            assert holds["requests"] == 1 and holds["blocks"] == len(blocks), holds
        finally:
            ctx.kill(signal.SIGCONT)

        run_until("the fenced receive's report", lambda: d.count("recving", "d-h") > 0, d)
        (at,) = [r for r in d.steps if "d-h" in r.recving]
        assert "d-h" in at.failed, at  # the same step
        released = d.dialed[-1].released("t-h")
        assert released is not None and released.how == "abort_ack", released
        for _ in range(5):
            d.step()
        assert d.reported("recving") == {"d-h": 1} and d.reported("failed") == {"d-h": 1}
        assert d.transfers.pending == 0
        (rec,) = d.records
        assert rec["status"] == outcome.status and rec["aborted"] is False, rec
        holds = status(gen)["holds"]
        assert holds["requests"] == 0 and holds["blocks"] == 0, holds
        no_sessions(gen)
        d.untouched(blocks)


def cut(client: Client) -> None:
    """The connection ends while the daemon lives on. Real causes (the daemon's shutdown
    between closing its engine API and exiting, a frame it refused) are not reproducible
    on demand; shutting the socket down from the client's side ends it the same way for
    both ends."""
    sock = client._client._writer.get_extra_info("socket")  # white-box: the fault itself
    sock.shutdown(socket.SHUT_RDWR)


def orphan_a_receive(ctx: DaemonProc, gen: DaemonProc, d: Worker, p: Worker) -> list[int]:
    """The connection to the generation daemon ends while that daemon lives, with a
    receive ("d-o") posted whose writer (the context daemon) is stopped, and left stopped:
    the daemon holds the blocks, since the stopped writer may still write into them (the
    engine's pool stays mapped there). vLLM must not hear of the receive (it would reuse
    the blocks), however many steps pass. A receive ("d-done") whose `done` outcome reached
    the client just before the end is reported done, at once. The blocks of "d-o"."""
    assert d.dialed[-1].daemon_process.pid == gen.proc.pid
    blocks = [7, 8, 9]
    post_known_to_its_writer(d, ctx, "d-o", "t-o", blocks)
    # Posted and served, its outcome at the client, but no step has taken it yet.
    done_blocks, p_blocks = [20, 21, 22], [30, 31, 32]
    d.clear(done_blocks)
    p.fill(p_blocks, seed=5)
    d.transfers.post(plan_recv("d-done", "t-done", ctx.peer_address, 40, done_blocks))
    p.step(plan_send("p-done", "t-done", 40, p_blocks), finished={"p-done"})
    started = d.transfers._entries["d-done"].started  # white-box: the arrival
    assert started is not None
    wait_for("the served receive's outcome at the client", started.done)
    ctx.kill(signal.SIGSTOP)
    cut(d.dialed[-1])
    wait_for("the client to see the end", lambda: bool(d.dialed[-1].gone))
    first = d.step()
    assert "d-done" in first.recving and "d-done" not in first.failed, first
    wait_for(
        "the daemon to hold the blocks of its gone engine's receive",
        lambda: status(gen)["holds"]["requests"] == 1,
    )
    held_until = time.monotonic() + 1.0
    steps = 0
    while time.monotonic() < held_until or steps < 10:
        got = d.step()
        assert "d-o" not in got.recving and "d-o" not in got.failed, got
        steps += 1
    assert d.transfers.pending == 1 and [r["status"] for r in d.records] == ["done"]
    d.holds_copy_of(p, done_blocks, p_blocks)
    return blocks


def reported_failed_once(d: Worker, blocks: list[int]) -> None:
    """The orphaned receive "d-o" reported failed, once, in one step, and nothing written
    into its blocks; "d-done" reported done, once."""
    run_until("the orphaned receive's report", lambda: d.count("recving", "d-o") > 0, d)
    (at,) = [r for r in d.steps if "d-o" in r.recving]
    assert "d-o" in at.failed, at  # the same step
    for _ in range(3):
        d.step()
    assert d.reported("recving") == {"d-o": 1, "d-done": 1}
    assert d.reported("failed") == {"d-o": 1}
    assert d.transfers.pending == 0
    assert [r["status"] != "done" for r in d.records] == [False, True], d.records
    assert all(np.all(d.block(b) == 0) for b in blocks)  # nothing was written
    d.untouched([*blocks, 20, 21, 22])  # and those of "d-done"


def test_a_receive_whose_connection_ended_fails_once_its_living_daemon_let_go(
    tmp_path: Path,
) -> None:
    """orphan_a_receive; then the writer resumes, its AbortAck ends the hold, and the
    daemon, living on, deregisters the old connection's pool. The connector, dialed again
    to the same daemon process, learns that it let go of the old connection
    (ConnectionState "gone") and reports the receive failed. Before, it waited for the
    daemon's exit: vLLM kept the request, and its blocks, for as long as the daemon ran."""
    with fencing_pair(tmp_path) as (ctx, gen, d, p):
        try:
            blocks = orphan_a_receive(ctx, gen, d, p)
            old = d.dialed[0]
            # Asked on a new connection to the same process: not let go of while held.
            assert len(d.dialed) == 2 and d.dialed[-1].daemon_process == old.daemon_process
            assert d.dialed[-1].connection_state(old.connection_id) == "closing"
        finally:
            ctx.kill(signal.SIGCONT)
        reported_failed_once(d, blocks)
        assert gen.alive() and d.dialed[-1].connection_state(old.connection_id) == "gone"
        assert status(gen)["holds"]["requests"] == 0


def test_a_receive_whose_connection_ended_fails_once_its_daemon_exited(
    tmp_path: Path,
) -> None:
    """orphan_a_receive; then the daemon is killed while it still holds the blocks: its
    end takes every write it brokered with it, and the receive is reported failed."""
    with fencing_pair(tmp_path) as (ctx, gen, d, p):
        try:
            blocks = orphan_a_receive(ctx, gen, d, p)
            gen.kill(signal.SIGKILL)
            gen.proc.wait(10)
            reported_failed_once(d, blocks)
        finally:
            ctx.kill(signal.SIGCONT)


def test_daemons_killed_then_restarted(daemons: Daemons, workers: Callable[..., Worker]) -> None:
    """Runs last: it kills both daemons of the module and leaves restarted ones behind."""
    d = workers(daemons.gen, "decode")
    p = workers(daemons.ctx, "prefill")
    peer = daemons.ctx.peer_address
    # A receive and a send that wait for each other's counterpart (other transfer ids).
    d.step(plan_recv("d-k", "t-k-recv", peer, 40, [1, 2, 3]))
    p.step(plan_send("p-k", "t-k-send", 40, [1, 2, 3]))  # finished_req_ids held back
    for _ in range(3):
        assert d.step() == Results(set(), set(), set())
        assert p.step() == Results(set(), set(), set())

    daemons.gen.kill(signal.SIGKILL)
    daemons.ctx.kill(signal.SIGKILL)
    wait_for("the connections to end", lambda: bool(d.dialed[-1].gone and p.dialed[-1].gone))
    got = d.step()
    assert got.recving == {"d-k"} and got.failed == {"d-k"}
    # The send failed too, but vLLM has not finished its request: not reported yet.
    for _ in range(3):
        assert not p.step().sending
        d.step()
    assert p.step(finished={"p-k"}).sending == {"p-k"}
    assert d.transfers.pending == p.transfers.pending == 0
    assert len(d.dialed) == len(p.dialed) == 1  # no work: nobody dialed a dead daemon

    # The same api sockets, new processes: the next post dials them.
    daemons.gen = daemons.start("gen", "generation")
    daemons.ctx = daemons.start("ctx", "context")
    prompt = 70
    p.fill([30, 31, 32, 33, 34], seed=4)
    d.clear([40, 41, 42, 43, 44])
    d.step(plan_recv("d-new", "t-new", daemons.ctx.peer_address, prompt, [40, 41, 42, 43, 44]))
    p.step(plan_send("p-new", "t-new", prompt, [30, 31, 32, 33, 34]), finished={"p-new"})
    assert len(d.dialed) == len(p.dialed) == 2
    both_reported("the transfer after the restart", d, "d-new", p, "p-new", then_steps=3)

    assert d.reported("recving") == {"d-k": 1, "d-new": 1} and d.reported("failed") == {"d-k": 1}
    assert p.reported("sending") == {"p-k": 1, "p-new": 1}
    d.holds_copy_of(p, [40, 41, 42, 43, 44], [30, 31, 32, 33, 34])
    d.untouched([40, 41, 42, 43, 44])
    no_sessions(daemons.gen)
    no_sessions(daemons.ctx)


def test_a_redial_neither_holds_the_step_back_nor_raises(tmp_path: Path) -> None:
    """The connection ends and the generation daemon is stopped (SIGSTOP): the next step's
    redial cannot finish (the daemon answers no hello). The step returns with the dial
    still under way on its own thread, the receive failed ("no daemon"), instead of
    waiting out the client's connect and hello timeouts (20 s); once the daemon runs
    again a later step picks the client up and transfers as usual. A dial that raises
    anything (the connector's ConnectorConfigError, before: out of vLLM's
    start_load_kv) fails the step's transfers and nothing more."""
    with fencing_pair(tmp_path) as (ctx, gen, d, p):
        cut(d.dialed[-1])
        wait_for("the client to see the end", lambda: bool(d.dialed[-1].gone))
        gen.kill(signal.SIGSTOP)
        try:
            d.clear([7, 8, 9])
            got = d.step(plan_recv("d-x", "t-x", ctx.peer_address, 40, [7, 8, 9]))
            dialing = d.transfers._dialing  # white-box: the dial the step left running
            assert dialing is not None and not dialing.done()
            assert "d-x" in got.recving and "d-x" in got.failed, got
            assert len(d.dialed) == 1
        finally:
            gen.kill(signal.SIGCONT)
        wait_for("the redial to end", dialing.done)
        p.fill([30, 31, 32], seed=9)
        d.clear([20, 21, 22])
        d.step(plan_recv("d-y", "t-y", ctx.peer_address, 40, [20, 21, 22]))
        p.step(plan_send("p-y", "t-y", 40, [30, 31, 32]), finished={"p-y"})
        both_reported("the transfer after the redial", d, "d-y", p, "p-y", then_steps=3)
        assert d.reported("failed") == {"d-x": 1} and len(d.dialed) == 2
        d.holds_copy_of(p, [20, 21, 22], [30, 31, 32])

        def refuse() -> Client:
            raise RuntimeError("KvxferdConnector: the daemon's role changed")

        lonely = Transfers(refuse, "nowhere", client=None)
        lonely.post(plan_recv("l-x", "t-lx", ctx.peer_address, 40, [1, 2, 3]))
        got = lonely.collect(set())
        assert "l-x" in got.recving and "l-x" in got.failed, got
        lonely.close()

"""The vLLM connector's parsing and planning, without vLLM (params.py, plan.py).

The scheduler side runs beside vLLM's scheduler, where an exception kills the engine: every
malformed input must come out as a ParamsError (parsing) or a Refusal / "no send" (planning),
and each planned or refused transfer must reach the worker exactly once.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvxferd.integrations.vllm.params import (
    ParamsError,
    Transfer,
    prefill_reply,
    remote_decode,
    remote_prefill,
)
from kvxferd.integrations.vllm.plan import Planner, RecvPlan, Refusal, SendPlan, StepPlan

BS = 16  # tokens per block
PEER = "127.0.0.1:4000"


def _recv_params(tid: Any = "t-1", **more: Any) -> dict[str, Any]:
    return {"do_remote_prefill": True, "kvxferd": {"transfer_id": tid, **more}}


def _send_params(tid: Any = "t-1") -> dict[str, Any]:
    return {"do_remote_decode": True, "kvxferd": {"transfer_id": tid}}


# ------------------------------------------------------------------------ params


@pytest.mark.parametrize("parse", [remote_prefill, remote_decode])
@pytest.mark.parametrize("params", [None, {}, {"kvxferd": {"transfer_id": "t"}}])
def test_no_params_or_no_flag_is_no_transfer(parse: Any, params: Any) -> None:
    assert parse(params) is None


def test_a_false_flag_is_no_transfer() -> None:
    assert remote_prefill({"do_remote_prefill": False, "kvxferd": {"transfer_id": "t"}}) is None
    assert remote_decode({"do_remote_decode": False, "kvxferd": {"transfer_id": "t"}}) is None
    # Each side reads its own flag only.
    assert remote_prefill(_send_params()) is None
    assert remote_decode(_recv_params()) is None


def test_the_transfers_asked_for() -> None:
    assert remote_prefill(_recv_params("t-1")) == Transfer("t-1", "")
    assert remote_prefill(_recv_params("a.B_9:x@y-z", peer=PEER)) == Transfer("a.B_9:x@y-z", PEER)
    assert remote_prefill(_recv_params("t", peer="ctx-0")) == Transfer("t", "ctx-0")
    assert remote_decode(_send_params("t-2")) == Transfer("t-2", "")
    assert remote_prefill(_recv_params("x" * 128)) == Transfer("x" * 128)


@pytest.mark.parametrize("parse", [remote_prefill, remote_decode])
@pytest.mark.parametrize("params", ["do_remote_prefill", ["do_remote_decode"], 1, True])
def test_params_that_are_not_an_object(parse: Any, params: Any) -> None:
    with pytest.raises(ParamsError, match="kv_transfer_params must be an object"):
        parse(params)


@pytest.mark.parametrize(
    ("parse", "flag"),
    [(remote_prefill, "do_remote_prefill"), (remote_decode, "do_remote_decode")],
)
def test_a_flag_without_the_kvxferd_section(parse: Any, flag: str) -> None:
    for params in ({flag: True}, {flag: True, "kvxferd": None}):
        with pytest.raises(ParamsError, match=r'kv_transfer_params\["kvxferd"\]') as err:
            parse(params)
        assert flag in str(err.value) and "transfer_id" in str(err.value)


@pytest.mark.parametrize(
    ("parse", "flag"),
    [(remote_prefill, "do_remote_prefill"), (remote_decode, "do_remote_decode")],
)
@pytest.mark.parametrize("section", ["t-1", ["t-1"], 7])
def test_a_kvxferd_section_that_is_not_an_object(parse: Any, flag: str, section: Any) -> None:
    with pytest.raises(ParamsError, match=r'kv_transfer_params\["kvxferd"\] must be an object'):
        parse({flag: True, "kvxferd": section})


BAD_IDS = [None, "", 7, ["t"], "has space", "tab\t", "semi;colon", "slash/", "é", "x" * 129]


@pytest.mark.parametrize(
    ("parse", "flag"),
    [(remote_prefill, "do_remote_prefill"), (remote_decode, "do_remote_decode")],
)
@pytest.mark.parametrize("tid", BAD_IDS)
def test_a_missing_or_bad_transfer_id(parse: Any, flag: str, tid: Any) -> None:
    section = {} if tid is None else {"transfer_id": tid}
    with pytest.raises(ParamsError, match=r'\["transfer_id"\]') as err:
        parse({flag: True, "kvxferd": section})
    assert flag in str(err.value)
    # The offending value is quoted, but bounded (it names a log line).
    assert len(str(err.value)) < 300


@pytest.mark.parametrize("peer", [7, None, ["a:1"], "host 1:2", "a:1\n", "p" * 257])
def test_a_bad_peer(peer: Any) -> None:
    with pytest.raises(ParamsError, match=r'\["peer"\]'):
        remote_prefill(_recv_params("t", peer=peer))


def test_params_errors_are_value_errors() -> None:
    # What the connector catches; nothing else may come out of parsing.
    assert issubclass(ParamsError, ValueError)


def test_prefill_reply() -> None:
    t = Transfer("t-9")
    assert prefill_reply(t, 100, "") == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvxferd": {"transfer_id": "t-9", "num_tokens": 100},
    }
    reply = prefill_reply(t, 33, PEER)
    assert reply["kvxferd"] == {"transfer_id": "t-9", "num_tokens": 33, "peer": PEER}
    # What the decode instance is given back parses as its receive.
    assert remote_prefill(reply) == Transfer("t-9", PEER)
    assert remote_decode(reply) is None


# ---------------------------------------------------------------- decode: matching


def _consumer() -> Planner:
    return Planner(BS, consumer=True, producer=False)


def _producer(advertise: str = "") -> Planner:
    return Planner(BS, consumer=False, producer=True, advertise_peer=advertise)


def _empty(plan: StepPlan) -> bool:
    return not plan.recvs and not plan.sends and not plan.refusals


def test_matched_tokens_is_the_prompt_less_the_local_hit() -> None:
    p = _consumer()
    assert p.matched_tokens("r", _recv_params(), 100, 0) == 100
    assert p.matched_tokens("r", _recv_params(), 100, 32) == 68
    assert p.matched_tokens("r", _recv_params(), 100, 100) == 0
    assert p.matched_tokens("r", _recv_params(), 100, 120) == 0  # never negative
    # Asked again and again: the same answer, and nothing planned.
    for _ in range(3):
        assert p.matched_tokens("r", _recv_params(), 100, 16) == 84
    assert _empty(p.take(0))


@pytest.mark.parametrize("params", [None, {}, {"do_remote_prefill": False}, _send_params()])
def test_nothing_to_match_without_a_remote_prefill(params: Any) -> None:
    assert _consumer().matched_tokens("r", params, 100, 0) == 0


@pytest.mark.parametrize(
    "params", ["junk", {"do_remote_prefill": True}, _recv_params("bad id"), _recv_params(peer=1)]
)
def test_malformed_params_are_matched_then_refused(params: Any) -> None:
    """Matching must not raise; the load is taken on and fails after the allocation, so
    that vLLM's failure policy applies to the one request."""
    p = _consumer()
    n = p.matched_tokens("r", params, 100, 0)
    assert n == 100
    p.after_alloc("r", params, 100, list(range(7)), n, PEER)
    plan = p.take(0)
    assert not plan.recvs and [r.req_id for r in plan.refusals] == ["r"]
    assert plan.refusals[0].reason


def test_nothing_to_match_once_the_load_was_planned() -> None:
    """Under kv_load_failure_policy=recompute vLLM asks again after a failed load: the answer
    must then be 0, or the request waits for remote KV forever."""
    p = _consumer()
    n = p.matched_tokens("r", _recv_params(), 100, 0)
    p.after_alloc("r", _recv_params(), 100, list(range(7)), n, PEER)
    assert p.matched_tokens("r", _recv_params(), 100, 0) == 0
    assert p.matched_tokens("other", _recv_params("t-2"), 100, 0) == 100
    # A refused load counts as planned too.
    p.refuse("other", "no")
    assert p.matched_tokens("other", _recv_params("t-2"), 100, 0) == 0


def test_a_producer_only_planner_matches_nothing() -> None:
    p = _producer()
    assert p.matched_tokens("r", _recv_params(), 100, 0) == 0
    p.after_alloc("r", _recv_params(), 100, list(range(7)), 0, PEER)
    assert _empty(p.take(0))


# ------------------------------------------------------------ decode: after alloc


def test_after_alloc_plans_the_receive() -> None:
    p = _consumer()
    n = p.matched_tokens("r", _recv_params("t-1"), 100, 0)
    blocks = [40, 41, 7, 3, 9, 10, 11, 12, 13]  # more than the prompt's 7 (decode growth)
    p.after_alloc("r", _recv_params("t-1"), 100, blocks, n, PEER)
    plan = p.take(0)
    assert plan.recvs == [RecvPlan("r", "t-1", PEER, (40, 41, 7, 3, 9, 10, 11), 0, 100)]
    assert not plan.sends and not plan.refusals


def test_after_alloc_starts_at_the_local_prefix_hit() -> None:
    p = _consumer()
    n = p.matched_tokens("r", _recv_params("t-1"), 100, 32)
    assert n == 68
    blocks = [5, 6, 20, 21, 22, 23, 24, 25]
    p.after_alloc("r", _recv_params("t-1"), 100, blocks, n, PEER)
    (recv,) = p.take(0).recvs
    # The first 2 blocks are the local hit; the prompt's 7 blocks end at index 7.
    assert recv.block_start == 2
    assert recv.blocks == (20, 21, 22, 23, 24)
    assert recv.num_tokens == 100  # still the whole prompt, from token 0


def test_the_peer_of_the_params_wins_over_the_default() -> None:
    p = _consumer()
    params = _recv_params("t-1", peer="ctx-7")
    p.after_alloc("r", params, 16, [1], p.matched_tokens("r", params, 16, 0), PEER)
    (recv,) = p.take(0).recvs
    assert recv.peer == "ctx-7" and recv.blocks == (1,)


def test_a_load_is_planned_once() -> None:
    p = _consumer()
    for _ in range(3):
        p.after_alloc("r", _recv_params(), 100, list(range(7)), 100, PEER)
    assert len(p.take(0).recvs) == 1
    p.after_alloc("r", _recv_params(), 100, list(range(7)), 100, PEER)
    assert _empty(p.take(0))


def test_no_external_tokens_plans_nothing() -> None:
    p = _consumer()
    p.after_alloc("r", _recv_params(), 100, list(range(7)), 0, PEER)
    assert _empty(p.take(0))
    # ...and did not count as planned.
    assert p.matched_tokens("r", _recv_params(), 100, 0) == 100


@pytest.mark.parametrize(
    ("params", "blocks", "prompt", "external", "default_peer", "words"),
    [
        ("junk", 7, 100, 100, PEER, ["kv_transfer_params must be an object"]),
        ({"do_remote_prefill": True}, 7, 100, 100, PEER, ['["kvxferd"]']),
        (_recv_params(""), 7, 100, 100, PEER, ['["transfer_id"]']),
        (_recv_params(peer="a b"), 7, 100, 100, PEER, ['["peer"]']),
        (_recv_params(), 7, 100, 100, "", ["no context peer", '"peer"']),
        (_recv_params(), 6, 100, 100, PEER, ["6 blocks allocated", "needs 7"]),
        (_recv_params(), 7, 100, 90, PEER, ["10 tokens", "block-aligned"]),
        ({"do_remote_decode": True}, 7, 100, 100, PEER, ["do_remote_prefill"]),
    ],
)
def test_after_alloc_refusals(
    params: Any,
    blocks: int,
    prompt: int,
    external: int,
    default_peer: str,
    words: list[str],
) -> None:
    p = _consumer()
    p.after_alloc("r", params, prompt, list(range(blocks)), external, default_peer)
    plan = p.take(0)
    assert not plan.recvs and not plan.sends
    assert [r.req_id for r in plan.refusals] == ["r"], plan
    for word in words:
        assert word in plan.refusals[0].reason, (word, plan.refusals[0].reason)
    # Reported once: the next plan is empty, and asking again plans nothing.
    assert p.matched_tokens("r", params, prompt, prompt - external) == 0
    p.after_alloc("r", params, prompt, list(range(blocks)), external, default_peer)
    assert _empty(p.take(0))


def test_refuse() -> None:
    p = _consumer()
    p.refuse("r", "planning raised")
    plan = p.take(5)
    assert plan.refusals == [Refusal("r", "planning raised")]
    assert _empty(p.take(5))
    p.after_alloc("r", _recv_params(), 100, list(range(7)), 100, PEER)
    assert _empty(p.take(5))


# --------------------------------------------------------------- prefill: finished


def test_finished_plans_the_send_and_returns_the_params() -> None:
    p = _producer(advertise="10.0.0.1:7000")
    blocks = [3, 4, 5, 6, 7, 8, 9, 10, 11]  # the prompt's 7, then the generated token's
    keep, reply = p.finished("r", _send_params("t-5"), True, 100, blocks)
    assert keep is True
    assert reply == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvxferd": {"transfer_id": "t-5", "num_tokens": 100, "peer": "10.0.0.1:7000"},
    }
    plan = p.take(0)
    assert plan.sends == [SendPlan("r", "t-5", (3, 4, 5, 6, 7, 8, 9), 100)]
    assert not plan.recvs and not plan.refusals
    assert _empty(p.take(0))


def test_finished_names_the_generation_daemon_it_serves() -> None:
    """A "peer" in the prefill's params is the decode daemon's name: the send serves it only."""
    params = {"do_remote_decode": True, "kvxferd": {"transfer_id": "t", "peer": "gen-7"}}
    p = _producer()
    keep, _ = p.finished("r", params, True, 40, [1, 2, 3])  # 40 tokens: 3 blocks of 16
    assert keep
    assert p.take(0).sends == [SendPlan("r", "t", (1, 2, 3), 40, "gen-7")]


def test_finished_without_an_advertised_peer() -> None:
    _, reply = _producer().finished("r", _send_params("t"), True, 16, [1])
    assert reply is not None and "peer" not in reply["kvxferd"]


@pytest.mark.parametrize(
    ("params", "normal", "blocks"),
    [
        (_send_params(), False, 7),  # aborted, or any abnormal end: no KV is complete
        (None, True, 7),
        ({}, True, 7),
        ({"do_remote_decode": False}, True, 7),
        (_recv_params(), True, 7),
        (_send_params(), True, 6),  # fewer blocks than the prompt's
    ],
)
def test_finished_without_a_send(params: Any, normal: bool, blocks: int) -> None:
    p = _producer()
    assert p.finished("r", params, normal, 100, list(range(blocks))) == (False, None)
    assert _empty(p.take(0))


@pytest.mark.parametrize(
    "params",
    [
        "junk",
        ["do_remote_decode"],
        {"do_remote_decode": True},
        {"do_remote_decode": True, "kvxferd": "t"},
        _send_params("bad id"),
        _send_params(7),
        {"do_remote_decode": True, "kvxferd": {"transfer_id": "t", "peer": 3}},
    ],
)
@pytest.mark.parametrize("normal", [True, False])
def test_finished_with_malformed_params_does_not_raise(params: Any, normal: bool) -> None:
    p = _producer()
    assert p.finished("r", params, normal, 100, list(range(7))) == (False, None)
    assert _empty(p.take(0))


def test_a_consumer_only_planner_sends_nothing() -> None:
    p = _consumer()
    assert p.finished("r", _send_params(), True, 100, list(range(7))) == (False, None)
    assert _empty(p.take(0))


def test_finished_forgets_the_planned_load() -> None:
    """A finished request's id is free again (vLLM does not reuse ids, but a planner that
    kept every id would grow without end)."""
    p = _consumer()
    p.after_alloc("r", _recv_params(), 100, list(range(7)), 100, PEER)
    p.take(0)
    assert p.finished("r", _recv_params(), True, 100, list(range(7))) == (False, None)
    assert p.matched_tokens("r", _recv_params(), 100, 0) == 100


# ------------------------------------------------------------------- each step


def test_take_says_idle_and_starts_afresh() -> None:
    p = Planner(BS, consumer=True, producer=True)
    assert p.take(0).idle is True
    assert p.take(1).idle is False
    p.after_alloc("d", _recv_params("t-d"), 32, [1, 2], 32, PEER)
    p.refuse("x", "why")
    p.finished("s", _send_params("t-s"), True, 20, [8, 9])
    plan = p.take(3)
    assert plan.idle is False
    assert [r.req_id for r in plan.recvs] == ["d"]
    assert [s.req_id for s in plan.sends] == ["s"]
    assert [r.req_id for r in plan.refusals] == ["x"]
    again = p.take(0)
    assert _empty(again) and again.idle is True

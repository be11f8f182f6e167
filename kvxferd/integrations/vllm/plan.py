"""The scheduler side of the vLLM connector: which transfers each step starts.

It runs in vLLM's EngineCore process, beside the scheduler, and only plans: every kvxferd
call is made by the worker (the process that owns the KV memory and whose connection the
daemon checks). What it decides reaches the worker as a `StepPlan` inside vLLM's connector
metadata, once per step.

Nothing here may raise on what a request carries: an exception in the scheduler kills the
engine and every request in it. A request whose params are malformed gets a `Refusal`
instead, which the worker reports as that request's failed load (vLLM's
`kv_load_failure_policy` then fails or recomputes it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvxferd.integrations.vllm.params import (
    ParamsError,
    Transfer,
    prefill_reply,
    remote_decode,
    remote_prefill,
)

log = logging.getLogger("kvxferd.vllm")


@dataclass(frozen=True)
class RecvPlan:
    """Decode: receive the prompt's KV of `transfer_id` into `blocks`, which hold the
    prompt's logical blocks [block_start, ...) (those before are a local prefix-cache hit)."""

    req_id: str
    transfer_id: str
    peer: str
    blocks: tuple[int, ...]
    block_start: int
    num_tokens: int


@dataclass(frozen=True)
class SendPlan:
    """Prefill: the KV of the prompt's `num_tokens` tokens, in `blocks`, is complete."""

    req_id: str
    transfer_id: str
    blocks: tuple[int, ...]
    num_tokens: int
    peer: str = ""  # the generation daemon (its name) the KV is for; "": whoever asks first


@dataclass(frozen=True)
class Refusal:
    """Decode: a remote load that cannot even be posted; reported failed, with `reason`."""

    req_id: str
    reason: str


@dataclass
class StepPlan:
    recvs: list[RecvPlan] = field(default_factory=list)
    sends: list[SendPlan] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    idle: bool = False  # the step schedules no tokens (the worker may wait for outcomes)


class Planner:
    """Per-request bookkeeping of one scheduler; `block_size` is vLLM's (= the daemons')
    tokens per block."""

    def __init__(
        self, block_size: int, *, consumer: bool, producer: bool, advertise_peer: str = ""
    ) -> None:
        self.block_size = block_size
        self.consumer = consumer
        self.producer = producer
        self.advertise_peer = advertise_peer
        # Decode requests whose remote load was planned (or refused): vLLM asks again after a
        # failed load under `recompute`, and must then hear "nothing to load", or the request
        # waits for remote KV forever.
        self._loaded: set[str] = set()
        self._next = StepPlan()

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -------------------------------------------------------------- decode side

    def matched_tokens(self, req_id: str, params: Any, prompt_len: int, local_hit: int) -> int:
        """How many prompt tokens arrive from the context instance (0: none). No side
        effects: vLLM may ask several times for one request."""
        if not self.consumer or req_id in self._loaded:
            return 0
        try:
            wanted = remote_prefill(params)
        except ParamsError:
            wanted = Transfer("")  # load it, and fail that load with the reason (after alloc)
        if wanted is None:
            return 0
        return max(prompt_len - local_hit, 0)

    def after_alloc(
        self,
        req_id: str,
        params: Any,
        prompt_len: int,
        block_ids: list[int],
        num_external_tokens: int,
        default_peer: str,
    ) -> None:
        """The request's blocks (all of them, its local prefix hit first) are allocated:
        plan its receive."""
        if num_external_tokens <= 0 or req_id in self._loaded:
            return
        self._loaded.add(req_id)
        try:
            wanted = remote_prefill(params)
        except ParamsError as exc:
            self._next.refusals.append(Refusal(req_id, str(exc)))
            return
        if wanted is None:  # params changed under us: cannot happen, refuse rather than hang
            self._next.refusals.append(Refusal(req_id, "no do_remote_prefill any more"))
            return
        peer = wanted.peer or default_peer
        if not peer:
            self._next.refusals.append(
                Refusal(
                    req_id,
                    'no context peer: set kv_transfer_params["kvxferd"]["peer"] or the '
                    'connector\'s kv_connector_extra_config "peer"',
                )
            )
            return
        local_hit = prompt_len - num_external_tokens
        if local_hit % self.block_size:
            # vLLM hands connectors block-aligned local hits; a partial block would need a
            # receive into a block other requests share.
            self._next.refusals.append(
                Refusal(req_id, f"local prefix hit of {local_hit} tokens is not block-aligned")
            )
            return
        start = local_hit // self.block_size
        end = self._blocks_for(prompt_len)
        if len(block_ids) < end:
            self._next.refusals.append(
                Refusal(req_id, f"{len(block_ids)} blocks allocated, the prompt needs {end}")
            )
            return
        self._next.recvs.append(
            RecvPlan(
                req_id, wanted.transfer_id, peer, tuple(block_ids[start:end]), start, prompt_len
            )
        )

    def refuse(self, req_id: str, reason: str) -> None:
        """Fail this request's remote load (the worker reports it failed next step)."""
        self._loaded.add(req_id)
        self._next.refusals.append(Refusal(req_id, reason))

    # ------------------------------------------------------------- prefill side

    def finished(
        self, req_id: str, params: Any, normal_end: bool, prompt_len: int, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's request_finished: (keep the blocks until the send ends, params to return)."""
        self._loaded.discard(req_id)
        if not self.producer:
            return False, None
        try:
            wanted = remote_decode(params)
        except ParamsError as exc:
            # The decode instance's receive then times out and its failure policy applies.
            log.warning("request %s: no KV sent: %s", req_id, exc)
            return False, None
        if wanted is None or not normal_end:
            return False, None
        need = self._blocks_for(prompt_len)
        if len(block_ids) < need:
            log.warning(
                "request %s (transfer %s): %d blocks for a %d-token prompt; no KV sent",
                req_id,
                wanted.transfer_id,
                len(block_ids),
                prompt_len,
            )
            return False, None
        self._next.sends.append(
            SendPlan(req_id, wanted.transfer_id, tuple(block_ids[:need]), prompt_len, wanted.peer)
        )
        return True, prefill_reply(wanted, prompt_len, self.advertise_peer)

    # --------------------------------------------------------------- each step

    def take(self, scheduled_tokens: int) -> StepPlan:
        """This step's plan (and a fresh one for the next step)."""
        plan, self._next = self._next, StepPlan()
        plan.idle = scheduled_tokens == 0
        return plan

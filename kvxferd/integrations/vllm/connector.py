"""`KvxferdConnector`: vLLM's KV connector (v1 API of vLLM 0.32) over kvxferd daemons.

Load it with
`kv_transfer_config={"kv_connector": "KvxferdConnector",
"kv_connector_module_path": "kvxferd.integrations.vllm", "kv_role": ...,
"kv_connector_extra_config": {"socket": "/run/kvxferd/engine.sock", ...}}`
and `disable_hybrid_kv_cache_manager=True`; docs/engine-integration.md has the whole
configuration.

vLLM makes one instance per process. The SCHEDULER one (EngineCore) plans (plan.Planner);
the WORKER one owns the daemon connection, puts vLLM's KV cache in a sealed memfd the daemon
maps (zero-copy: the daemon writes received KV straight into decode's blocks and reads
prefill's blocks in place), and turns every kvxferd outcome into exactly one vLLM completion
(transfers.Transfers). Everything the two share goes through vLLM's connector metadata.

What is refused at start-up, with the reason, rather than risk wrong tokens: another vLLM
version, tensor or pipeline parallelism, more than one KV cache group, a KV cache that is not
the CPU backend's layout (memory.describe_kv_caches), a daemon whose tokens_per_block is not
vLLM's block_size, a daemon of the wrong role, and a daemon that is not running.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus

from kvxferd.client import CallError, Client, DaemonGoneError
from kvxferd.integrations.vllm.memory import KvBuffer, describe_kv_caches, kv_in_memfd
from kvxferd.integrations.vllm.plan import Planner, StepPlan
from kvxferd.integrations.vllm.transfers import Transfers

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

#: The vLLM versions this connector was built and tested against.
SUPPORTED_VLLM = ("0.32.0",)

log = logging.getLogger("kvxferd.vllm")


def _log_to_stderr() -> None:
    """vLLM configures only its own loggers; without this the connector's warnings
    (failed transfers, a lost daemon) would go nowhere."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvxferd] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


class ConnectorConfigError(RuntimeError):
    """The vLLM configuration or the daemon does not fit this connector."""


@dataclass
class KvxferdMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler to the worker (vLLM pickles it between its own
    processes; it never reaches a socket of ours)."""

    plan: StepPlan


@dataclass(frozen=True)
class Settings:
    """`kv_connector_extra_config`, checked."""

    socket: str
    engine: str
    pool_id: str
    peer: str  # decode: the default context daemon to receive from
    advertise_peer: str  # prefill: returned in the params, for routers that chain requests
    idle_wait_ms: float
    outcome_log: str  # a JSON-lines file: one line per reported transfer ("": none)

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = {
            "socket",
            "engine",
            "pool_id",
            "peer",
            "advertise_peer",
            "idle_wait_ms",
            "outcome_log",
        }
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConnectorConfigError(
                f"kv_connector_extra_config: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        for key in known - {"idle_wait_ms"}:
            if key in extra and not isinstance(extra[key], str):
                raise ConnectorConfigError(f"kv_connector_extra_config.{key} must be a string")
        idle = extra.get("idle_wait_ms", 5.0)
        if isinstance(idle, bool) or not isinstance(idle, int | float) or not 0 <= idle <= 100:
            raise ConnectorConfigError(
                f"kv_connector_extra_config.idle_wait_ms must be 0 to 100, got {idle!r}"
            )
        socket = extra.get("socket") or os.environ.get("KVXFERD_SOCKET", "")
        engine = extra.get("engine") or "vllm"
        return cls(
            socket=socket,
            engine=engine,
            pool_id=extra.get("pool_id") or f"{engine}-kv",
            peer=extra.get("peer", ""),
            advertise_peer=extra.get("advertise_peer", ""),
            idle_wait_ms=float(idle),
            outcome_log=extra.get("outcome_log", ""),
        )


def _check_vllm(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    if vllm.__version__ not in SUPPORTED_VLLM:
        raise ConnectorConfigError(
            f"KvxferdConnector supports vLLM {', '.join(SUPPORTED_VLLM)}; this is vLLM "
            f"{vllm.__version__} (scripts/install-vllm.sh installs the supported one)"
        )
    par = vllm_config.parallel_config
    if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
        raise ConnectorConfigError(
            "KvxferdConnector runs one worker per instance for now: tensor_parallel_size "
            f"{par.tensor_parallel_size}, pipeline_parallel_size "
            f"{par.pipeline_parallel_size} (both must be 1)"
        )
    if len(kv_cache_config.kv_cache_groups) != 1:
        raise ConnectorConfigError(
            f"KvxferdConnector needs one KV cache group, the model has "
            f"{len(kv_cache_config.kv_cache_groups)} (start vLLM with "
            "--disable-hybrid-kv-cache-manager)"
        )


class KvxferdConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_to_stderr()
        _check_vllm(vllm_config, kv_cache_config)
        self.settings = Settings.parse(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        tc = self._kv_transfer_config
        self.consumer = bool(tc.is_kv_consumer)
        self.producer = bool(tc.is_kv_producer)
        self._planner: Planner | None = None
        self._transfers: Transfers | None = None
        self._buffer = KvBuffer()
        self._client: Client | None = None
        self._layout: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self._planner = Planner(
                self.block_size,
                consumer=self.consumer,
                producer=self.producer,
                advertise_peer=self.settings.advertise_peer,
            )
        else:
            # Dial now: a daemon that is not there fails vLLM's start-up with this message
            # (the worker's exception text reaches the operator), not the first request.
            self._client = self._dial()

    # ------------------------------------------------------------- the daemon

    def _dial(self) -> Client:
        s = self.settings
        if not s.socket:
            raise ConnectorConfigError(
                "KvxferdConnector needs the daemon's engine socket: "
                'kv_connector_extra_config {"socket": PATH} (the daemon\'s daemon.api_socket) '
                "or KVXFERD_SOCKET"
            )
        try:
            client = Client(s.socket, engine=s.engine)
        except (DaemonGoneError, CallError, OSError) as exc:
            raise ConnectorConfigError(
                f"KvxferdConnector: no kvxferd daemon at {s.socket} ({exc}); start "
                "`kvxferd run --config ...` beside this vLLM instance first"
            ) from exc
        # A daemon of role "both" serves any kv_role; otherwise the roles must match.
        if self.consumer and self.producer:
            allowed = {"both"}
        else:
            allowed = {"generation" if self.consumer else "context", "both"}
        if client.role not in allowed:
            client.close()
            raise ConnectorConfigError(
                f"KvxferdConnector (kv_role {self._kv_transfer_config.kv_role}) needs a daemon "
                f"of role {' or '.join(sorted(allowed))}; {client.daemon} at "
                f"{s.socket} is {client.role}"
            )
        if client.tokens_per_block != self.block_size:
            client.close()
            raise ConnectorConfigError(
                f"vLLM's block_size is {self.block_size} but daemon {client.daemon} moves "
                f"blocks of {client.tokens_per_block} tokens: set its "
                "engine.kv_layout.tokens_per_block to the block_size"
            )
        return client

    def _redial(self) -> Client:
        """After a daemon restart: the same memory, registered again. DaemonGoneError when
        no fitting daemon answers: the transfers fail, and vLLM goes on."""
        try:
            client = self._dial()
        except ConnectorConfigError as exc:
            raise DaemonGoneError(str(exc)) from exc
        assert self._buffer.region is not None and self._layout is not None
        try:
            client.register_pool(self.settings.pool_id, self._buffer.region, self._layout)
        except BaseException:
            client.close()
            raise
        return client

    # ----------------------------------------------------------- worker side

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        return kv_in_memfd(self._buffer)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        region = self._buffer.region
        if region is None:
            raise ConnectorConfigError(
                "vLLM allocated its KV cache outside the connector's memory context "
                "(get_mem_pool_context): the daemon could not reach it"
            )
        layout = describe_kv_caches(kv_caches, region.address, region.nbytes)
        if layout.num_blocks != self._kv_cache_config.num_blocks:
            raise ConnectorConfigError(
                f"the KV cache tensors hold {layout.num_blocks} blocks, vLLM's scheduler "
                f"counts {self._kv_cache_config.num_blocks}: kernel and manager block sizes "
                "differ, which this connector does not handle"
            )
        assert self._client is not None
        try:
            self._client.register_pool(self.settings.pool_id, region, layout)
        except (CallError, DaemonGoneError) as exc:
            raise ConnectorConfigError(
                f"daemon {self._client.daemon} refused vLLM's KV cache as pool "
                f"{self.settings.pool_id!r}: {exc}"
            ) from exc
        self._layout = layout
        self._transfers = Transfers(
            self._redial,
            self.settings.pool_id,
            client=self._client,
            idle_wait_s=self.settings.idle_wait_ms / 1000,
            record=self._recorder(),
        )
        log.info(
            "vLLM KV cache (%d layers x %d blocks of %d tokens, %d bytes) is pool %r of daemon %s",
            layout.num_layers,
            layout.num_blocks,
            layout.tokens_per_block,
            layout.pool_bytes,
            self.settings.pool_id,
            self._client.daemon,
        )

    def _recorder(self) -> Callable[[dict[str, object]], None] | None:
        path = self.settings.outcome_log
        if not path:
            return None
        sink = open(path, "a", buffering=1)  # noqa: SIM115 - open for the worker's lifetime

        def record(entry: dict[str, object]) -> None:
            sink.write(json.dumps(entry) + "\n")

        return record

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # After this step's forward (vLLM starts async loads then, and after its own block
        # zeroing): receives land in blocks nothing writes any more, and every finished
        # prefill's KV is complete.
        if self._transfers is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferdMetadata)
        self._transfers.post(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # whole-prompt loads complete before the request is scheduled

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # the daemon reads the blocks in place once the prompt is done

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._transfers is None:
            return KVConnectorTransferResults()
        idle = False
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            idle = isinstance(meta, KvxferdMetadata) and meta.plan.idle
        got = self._transfers.collect(finished_req_ids, idle=idle)
        return KVConnectorTransferResults(
            finished_sending=got.sending, finished_recving=got.recving, failed_recving=got.failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        got = self.get_transfer_results(finished_req_ids)
        return got.finished_sending or None, got.finished_recving or None

    def shutdown(self) -> None:
        if self._transfers is not None:
            self._transfers.close()
        elif self._client is not None:
            self._client.close()

    # -------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._planner is not None
        try:
            n = self._planner.matched_tokens(
                request.request_id,
                request.kv_transfer_params,
                request.num_prompt_tokens,
                num_computed_tokens,
            )
        except Exception:  # a bug here must not kill the engine
            log.exception("request %s: matching remote KV", request.request_id)
            return 0, False
        return n, n > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._planner is not None
        try:
            self._planner.after_alloc(
                request.request_id,
                request.kv_transfer_params,
                request.num_prompt_tokens,
                list(blocks.get_block_ids()[0]) if num_external_tokens else [],
                num_external_tokens,
                self.settings.peer,
            )
        except Exception as exc:  # fail the one request, not the engine
            log.exception("request %s: planning its receive", request.request_id)
            self._planner.refuse(request.request_id, repr(exc))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._planner is not None
        return KvxferdMetadata(self._planner.take(scheduler_output.total_num_scheduled_tokens))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._planner is not None
        normal = request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        )
        try:
            return self._planner.finished(
                request.request_id,
                request.kv_transfer_params,
                normal,
                request.num_prompt_tokens,
                list(block_ids),
            )
        except Exception:  # free the blocks, keep the engine
            log.exception("request %s: planning its send", request.request_id)
            return False, None

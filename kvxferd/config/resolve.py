"""Resolution: from what a file says to what the daemon will do, and why.

The seed's rules, applied once at start-up (and by `kvxferd config validate`):

* backend DEFAULT, or null, means NIXL;
* transceiver_runtime null means CPP; 'auto' adopts the engine's declared
  preferred runtime, else PYTHON, falling back to CPP only when the config
  itself rules PYTHON out (backend not NIXL, or kv_transfer_timeout_ms null);
  the fallback is logged and explained, not an error;
* PYTHON (chosen explicitly or through the engine's preference) with a non-NIXL
  backend or a null kv_transfer_timeout_ms is an error;
* kv_cache_bounce_size_mb > 0 with the CPP runtime is unused (a note);
* enable_pipelined_transfer needs every static requirement of the seed;
* max_tokens_in_buffer, when set, is a positive multiple of tokens_per_block and
  sets the admission window (in blocks);
* engine.kv_memory vram (GPU pools, kvxferd's own setting: the seed has none) needs
  the NIXL backend and, with the PYTHON runtime, a bounce buffer and no pipelining,
  because device pools move only through the daemon's device staging here.

Every problem is collected and raised together as one ConfigError.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from typing import Literal

from kvxferd.config.diagnostics import show
from kvxferd.config.model import KvxferdConfig
from kvxferd.errors import ConfigError

logger = logging.getLogger("kvxferd.config")

EffectiveBackend = Literal["NIXL", "UCX", "MPI", "MOONCAKE"]
EffectiveRuntime = Literal["PYTHON", "CPP"]
KvMemory = Literal["host", "vram"]

_CTC = "cache_transceiver_config"
PIPELINE_OK_BLOCK_REUSE = ("disabled", "all_reusable")


@dataclass(frozen=True)
class ResolvedSettings:
    """The effective transceiver settings of one daemon, each with the reason for it."""

    backend: EffectiveBackend
    runtime: EffectiveRuntime
    runtime_reason: str
    bounce_buffer_mb: int
    """Effective bounce buffer size per region: 0 when off or unused."""
    bounce_reason: str
    pipelined_transfer: bool
    pipelined_reason: str
    admission_window_blocks: int | None
    """ceil(max_tokens_in_buffer / tokens_per_block); None: no window."""
    kv_transfer_timeout_ms: int | None
    kv_transfer_sender_future_timeout_ms: int | None
    kv_transfer_poll_interval_ms: int | None
    max_tokens_in_buffer: int | None
    notes: tuple[str, ...] = ()
    """Things worth an operator's attention that are not errors (unused settings...)."""
    backend_reason: str = ""
    # GPU pools (engine.kv_memory, engine.cuda_device, daemon.device_zero_copy). Last and
    # defaulted: a host daemon's settings are what they were before device pools.
    kv_memory: KvMemory = "host"
    cuda_device: int = 0
    device_zero_copy: bool = False

    def peer_compat_fields(self) -> dict[str, object]:
        """The settings both peers of a transfer must agree on."""
        fields: dict[str, object] = {
            "backend": self.backend,
            "runtime": self.runtime,
            "pipelined_transfer": self.pipelined_transfer,
        }
        # Only when vram: every host daemon keeps the fingerprint it always had (older
        # peers still pair with it), and a vram daemon pairs with vram daemons only, since
        # a peer writes into our device staging with the memory kind it was built for.
        if self.kv_memory == "vram":
            fields["kv_memory"] = self.kv_memory
        return fields

    def fingerprint(self) -> str:
        """Short hex digest of `peer_compat_fields()`, compared in the handshake."""
        canonical = json.dumps(self.peer_compat_fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_json_dict(self) -> dict[str, object]:
        """Every setting and reason as plain JSON values, plus the fingerprint."""
        out: dict[str, object] = asdict(self)
        out["notes"] = list(self.notes)
        out["fingerprint"] = self.fingerprint()
        return out


def _backend(cfg: KvxferdConfig) -> tuple[EffectiveBackend, str]:
    backend = cfg.cache_transceiver_config.backend
    if backend is None:
        return "NIXL", "backend is not set (null), which means DEFAULT: NIXL"
    if backend == "DEFAULT":
        return "NIXL", "backend DEFAULT means NIXL"
    return backend, f"backend is {backend}"


def _runtime(
    cfg: KvxferdConfig, backend: EffectiveBackend, problems: list[str], notes: list[str]
) -> tuple[EffectiveRuntime, str]:
    ctc, src = cfg.cache_transceiver_config, cfg.source
    blockers: dict[str, str] = {}
    if backend != "NIXL":
        blockers["backend"] = f"the backend is {backend}, not NIXL"
    if ctc.kv_transfer_timeout_ms is None:
        blockers["kv_transfer_timeout_ms"] = "kv_transfer_timeout_ms is null"
    requested = ctc.transceiver_runtime
    why_python = "transceiver_runtime is PYTHON"
    if requested is None:
        return "CPP", "transceiver_runtime is null, which means CPP (the C++ staged transceiver)"
    if requested == "CPP":
        return "CPP", "transceiver_runtime is CPP (the C++ staged transceiver)"
    if requested == "auto":
        preferred = cfg.engine.preferred_transceiver_runtime
        if preferred == "CPP":
            return "CPP", (
                "auto, and the engine declares CPP as its preferred runtime "
                "(engine.preferred_transceiver_runtime)"
            )
        if preferred is None and blockers:
            reason = (
                "auto, no engine preference, and this config rules PYTHON out "
                f"({'; '.join(blockers.values())}): falling back to CPP. The fallback is "
                "decided on each server independently; keep the context and generation "
                "configurations consistent"
            )
            notes.append(f"{src}: {cfg.yaml_path(_CTC + '.transceiver_runtime')}: {reason}")
            return "CPP", reason
        if preferred is None:
            return "PYTHON", (
                "auto, no engine preference, and nothing in this config rules PYTHON out "
                "(NIXL backend, finite kv_transfer_timeout_ms)"
            )
        why_python = (
            "transceiver_runtime is auto and the engine declares PYTHON as its preferred "
            "runtime (engine.preferred_transceiver_runtime)"
        )
    fixes = {
        "backend": "set backend: NIXL (or DEFAULT), or transceiver_runtime: CPP",
        "kv_transfer_timeout_ms": "set a finite timeout such as 60000, or transceiver_runtime: CPP",
    }
    for key, blocker in blockers.items():
        problems.append(
            f"{src}: {cfg.yaml_path(f'{_CTC}.{key}')}: the PYTHON transceiver needs NIXL and a "
            f"finite kv_transfer_timeout_ms, and {blocker}; the runtime is PYTHON because "
            f"{why_python}; {fixes[key]}"
        )
    return "PYTHON", why_python


def _bounce(cfg: KvxferdConfig, runtime: EffectiveRuntime, notes: list[str]) -> tuple[int, str]:
    size = cfg.cache_transceiver_config.kv_cache_bounce_size_mb
    if size == 0:
        return 0, "off: kv_cache_bounce_size_mb is 0, so blocks are written one by one"
    if runtime == "PYTHON":
        return size, (
            f"on: {size} MiB per region (one for send, one for receive); a request's "
            "scattered blocks are gathered into one contiguous buffer and written at once"
        )
    reason = (
        f"unused: kv_cache_bounce_size_mb is {size}, but only the PYTHON transceiver uses the "
        "bounce buffer and the effective runtime is CPP"
    )
    notes.append(f"{cfg.source}: {cfg.yaml_path(_CTC + '.kv_cache_bounce_size_mb')}: {reason}")
    return 0, reason


def _memory_problems(
    cfg: KvxferdConfig, backend: EffectiveBackend, runtime: EffectiveRuntime, notes: list[str]
) -> list[str]:
    """What rules out engine.kv_memory vram with these settings (empty for host pools)."""
    ctc, src = cfg.cache_transceiver_config, cfg.source
    where = f"engine.kv_memory is vram ({cfg.yaml_path('engine.kv_memory')})"
    if cfg.engine.kv_memory == "host":
        if cfg.daemon.device_zero_copy:
            notes.append(
                f"{src}: {cfg.yaml_path('daemon.device_zero_copy')}: unused: it applies to "
                "GPU pools only, and engine.kv_memory is host"
            )
        return []
    problems = []
    if backend != "NIXL":
        problems.append(
            f"{src}: {cfg.yaml_path(_CTC + '.backend')}: {where}, but the backend is "
            f"{backend}: device pools move through NIXL VRAM registrations, and UCX, MPI and "
            "MOONCAKE move host memory only here; set backend: NIXL (or DEFAULT)"
        )
    if runtime == "PYTHON" and ctc.kv_cache_bounce_size_mb == 0:
        problems.append(
            f"{src}: {cfg.yaml_path(_CTC + '.kv_cache_bounce_size_mb')}: {where} and the "
            "runtime is PYTHON, which moves device pools only through its bounce buffer (in "
            "device memory), and kv_cache_bounce_size_mb is 0; set it to at least the largest "
            "request in MiB, or use transceiver_runtime: CPP"
        )
    if runtime == "PYTHON" and ctc.enable_pipelined_transfer:
        problems.append(
            f"{src}: {cfg.yaml_path(_CTC + '.enable_pipelined_transfer')}: {where}, and "
            "the PYTHON runtime bounces a device pool's request whole, never chunk by chunk; "
            "set enable_pipelined_transfer: false"
        )
    return problems


def memory_text(settings: ResolvedSettings) -> str:
    """Where the KV pools live, in words ("host memory", "vram on cuda:0 (zero-copy off)")."""
    if settings.kv_memory == "host":
        return "host memory (engine.kv_memory: host)"
    zero_copy = "on, where NIXL registers a pool" if settings.device_zero_copy else "off"
    return f"vram on cuda:{settings.cuda_device} (zero-copy {zero_copy})"


def pipelined_failures(
    cfg: KvxferdConfig, backend: EffectiveBackend, runtime: EffectiveRuntime
) -> list[tuple[str, str]]:
    """(kvxferd path, requirement) for each static pipelining requirement that fails."""
    ctc, eng = cfg.cache_transceiver_config, cfg.engine
    checks: list[tuple[bool, str, str]] = [
        (
            runtime == "PYTHON" and backend == "NIXL",
            f"{_CTC}.transceiver_runtime",
            f"needs the PYTHON runtime over NIXL (effective: {runtime} over {backend})",
        ),
        (
            eng.scheduling == "generation-first",
            "engine.scheduling",
            f"needs generation-first scheduling (got {show(eng.scheduling)}; in a TensorRT-LLM "
            "file: schedule_style: generation_first)",
        ),
        (
            eng.enable_chunked_prefill,
            "engine.enable_chunked_prefill",
            "needs chunked prefill (enable_chunked_prefill: true; got false)",
        ),
        (
            eng.pipeline_parallel_size == 1,
            "engine.pipeline_parallel_size",
            f"needs pipeline_parallel_size 1 (got {eng.pipeline_parallel_size})",
        ),
        (
            eng.context_parallel_size == 1,
            "engine.context_parallel_size",
            f"needs context_parallel_size 1 (got {eng.context_parallel_size})",
        ),
        (
            eng.max_beam_width == 1,
            "engine.max_beam_width",
            f"needs max_beam_width 1 (got {eng.max_beam_width})",
        ),
        (
            ctc.kv_cache_bounce_size_mb == 0,
            f"{_CTC}.kv_cache_bounce_size_mb",
            f"needs no bounce buffer: kv_cache_bounce_size_mb 0 "
            f"(got {ctc.kv_cache_bounce_size_mb})",
        ),
        (
            eng.cache_kind != "mamba-hybrid",
            "engine.cache_kind",
            "does not support a Mamba/hybrid cache (got 'mamba-hybrid')",
        ),
        (
            eng.block_reuse in PIPELINE_OK_BLOCK_REUSE,
            "engine.block_reuse",
            f"needs block reuse 'disabled' or 'all_reusable' (got {show(eng.block_reuse)})",
        ),
    ]
    return [(path, text) for ok, path, text in checks if not ok]


def resolve(cfg: KvxferdConfig) -> ResolvedSettings:
    """Apply the seed's rules to `cfg`; raise ConfigError listing every problem."""
    ctc, src = cfg.cache_transceiver_config, cfg.source
    problems: list[str] = []
    notes: list[str] = []
    backend, backend_reason = _backend(cfg)
    runtime, runtime_reason = _runtime(cfg, backend, problems, notes)
    bounce_mb, bounce_reason = _bounce(cfg, runtime, notes)

    pipelined, pipelined_reason = False, "off: enable_pipelined_transfer is false"
    if ctc.enable_pipelined_transfer:
        failures = pipelined_failures(cfg, backend, runtime)
        for path, text in failures:
            problems.append(
                f"{src}: {cfg.yaml_path(path)}: pipelined transfer "
                f"(enable_pipelined_transfer: true) {text}"
            )
        pipelined = not failures
        pipelined_reason = (
            "on: every static requirement holds (PYTHON over NIXL, generation-first "
            "scheduling, chunked prefill, pipeline and context parallel size 1, beam width 1, "
            f"no bounce buffer, no Mamba/hybrid cache, block reuse {cfg.engine.block_reuse!r}); "
            "the peer's settings are checked in the handshake, and a request that breaks a "
            "per-request constraint is rejected"
        )

    problems += _memory_problems(cfg, backend, runtime, notes)

    tokens = ctc.max_tokens_in_buffer
    per_block = cfg.engine.kv_layout.tokens_per_block
    window: int | None = None
    if tokens is not None:
        if tokens <= 0 or tokens % per_block:
            below = tokens // per_block * per_block if tokens > 0 else 0
            hint = ", ".join(str(v) for v in (below, below + per_block) if v > 0)
            problems.append(
                f"{src}: {cfg.yaml_path(_CTC + '.max_tokens_in_buffer')}: must be a positive "
                f"multiple of tokens_per_block ({per_block}, "
                f"{cfg.yaml_path('engine.kv_layout.tokens_per_block')}) (got {tokens}; "
                f"nearest valid: {hint})"
            )
        else:
            window = -(-tokens // per_block)

    if problems:
        count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
        raise ConfigError(f"{src}: the settings cannot work together ({count})", problems)
    for note in notes:
        logger.warning("%s", note)
    return ResolvedSettings(
        backend=backend,
        runtime=runtime,
        runtime_reason=runtime_reason,
        bounce_buffer_mb=bounce_mb,
        bounce_reason=bounce_reason,
        pipelined_transfer=pipelined,
        pipelined_reason=pipelined_reason,
        admission_window_blocks=window,
        kv_transfer_timeout_ms=ctc.kv_transfer_timeout_ms,
        kv_transfer_sender_future_timeout_ms=ctc.kv_transfer_sender_future_timeout_ms,
        kv_transfer_poll_interval_ms=ctc.kv_transfer_poll_interval_ms,
        max_tokens_in_buffer=tokens,
        notes=tuple(notes),
        backend_reason=backend_reason,
        kv_memory=cfg.engine.kv_memory,
        cuda_device=cfg.engine.cuda_device,
        device_zero_copy=cfg.daemon.device_zero_copy,
    )

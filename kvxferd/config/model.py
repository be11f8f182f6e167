"""`CacheTransceiverConfig` (the seed's model) and `KvxferdConfig`, a whole file.

The seed (shared/seed/CacheTransceiverConfig.txt) is the specification of
CacheTransceiverConfig: its fields, types, defaults and constraints are copied
exactly, and each field's description carries the seed's meaning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from kvxferd.config.diagnostics import format_validation_error, show
from kvxferd.config.sections import DaemonSection, EngineSection
from kvxferd.errors import ConfigError

Backend = Literal["DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI"]
TransceiverRuntime = Literal["CPP", "PYTHON", "auto"]
PositiveMs = Annotated[int, Field(gt=0)]


class CacheTransceiverConfig(BaseModel):
    """Configuration for the cache transceiver (the seed's model, field for field).

    Unknown keys are rejected and values are not coerced: `"60000"` (a string) is
    not an integer, `nixl` is not `NIXL`.

    The seed's model is also a `PybindMirror`, whose methods keep a Python model
    and a C++ (pybind) class in step. kvxferd has no C++ binding; what crosses a
    boundary here is a peer daemon's handshake, so the mirror becomes:

    * `maybe_to_pybind(ins)` (convert to the binding's object) -> `advertised()`,
      the plain JSON-able dict this daemon sends its peers.
    * `from_pybind(instance)` (rebuild from the binding's object) ->
      `from_advertised(data)`, which validates a peer's dict like a file (a key
      the peer leaves out takes its default; an unknown key is a ConfigError).
    * `pybind_equals(a, b)` -> `differences(other)`: an empty list means equal,
      otherwise one human line per differing field (`==` still compares models).
    * `get_pybind_enum_fields`, `get_pybind_variable_fields`, `mirror_pybind_enum`
      and `mirror_pybind_fields` introspect a C++ class to check that the Python
      fields and enums mirror it. Without a C++ class they have nothing to
      inspect and no counterpart: this model is the single source of truth, and
      the test suite checks its fields against the seed instead.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    backend: Backend | None = Field(
        default=None,
        description="The communication backend type to use for the cache transceiver. "
        "DEFAULT and null both mean NIXL.",
    )
    transceiver_runtime: TransceiverRuntime | None = Field(
        default="auto",
        description="The runtime implementation. 'auto' (default) adopts the model's "
        "preferred runtime when it declares one; otherwise it selects the Python "
        "transceiver, falling back to the C++ transceiver only when this config itself "
        "rules it out (non-NIXL backend or a null kv_transfer_timeout_ms); any other "
        "incompatibility fails at transceiver creation. The fallback is decided "
        "independently on each server, so keep context and generation server "
        "configurations consistent. 'CPP' selects the C++ (staged) transceiver, 'PYTHON' "
        "the Python (v2) transceiver. null is equivalent to 'CPP'.",
    )
    max_tokens_in_buffer: int | None = Field(
        default=None,
        description="The max number of tokens the transfer buffer can fit. When set it "
        "must be a positive multiple of tokens_per_block; it also sets the admission "
        "window (max_tokens_in_buffer / tokens_per_block blocks in flight).",
    )
    kv_transfer_timeout_ms: PositiveMs | None = Field(
        default=60000,
        description="KV cache transfer timeout in milliseconds. Blocking sender waits use "
        "it as an absolute deadline; blocking receive task waits use it per task. The "
        "Python (v2) transceiver requires a finite value; null remains available to other "
        "runtimes. It is distinct from the sender future wait slice.",
    )
    kv_transfer_sender_future_timeout_ms: PositiveMs | None = Field(
        default=1000,
        description="Duration in milliseconds of each bounded sender future wait slice "
        "while polling KV transfer completion. It does not set the overall transfer "
        "deadline.",
    )
    kv_transfer_poll_interval_ms: PositiveMs | None = Field(
        default=5000,
        description="Bounded wait interval in milliseconds for polling KV transfer progress "
        "when active transfers block disaggregated admission.",
    )
    kv_cache_bounce_size_mb: int = Field(
        default=0,
        ge=0,
        description="Per-region size in MiB of the KV-cache bounce buffer (one for send, "
        "one for recv). Bounce coalesces a request's scattered per-block KV into one "
        "contiguous buffer and issues a single write. The size doubles as the on/off "
        "switch: 0 (default) keeps the per-block path, >0 enables bounce at that "
        "capacity. Only used by the Python (v2) transceiver.",
    )
    enable_pipelined_transfer: bool = Field(
        default=False,
        description="Transfer each completed prefill chunk's KV cache while later chunks "
        "compute. Requires Python NIXL, generation-first scheduling, chunked prefill, "
        "pipeline_parallel_size=1, context_parallel_size=1 on both peers, beam_width=1, no "
        "bounce buffer or Mamba/hybrid cache, and block reuse disabled or set to "
        "all_reusable. Invalid static settings fail at startup; per-request constraints "
        "reject the request.",
    )

    def advertised(self) -> dict[str, object]:
        """Every field as a plain JSON-able dict, for the peer handshake."""
        return self.model_dump(mode="json")

    @classmethod
    def from_advertised(
        cls, data: Mapping[str, object], *, source: str = "peer settings"
    ) -> CacheTransceiverConfig:
        """Validate the settings a peer advertised, exactly as a file's section is.

        Raises ConfigError with one problem per bad or unknown key.
        """
        if not isinstance(data, Mapping):
            problem = f"{source}: must be a mapping of cache_transceiver_config fields"
            raise ConfigError(problem, problems=[f"{problem} (got {show(data)})"])
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            problems = format_validation_error(exc, root=cls, source=source)
            raise ConfigError(f"{source}: invalid cache_transceiver_config", problems) from None

    def differences(self, other: CacheTransceiverConfig) -> list[str]:
        """One line per field whose value differs: "field: ours X, peer Y"."""
        lines = []
        for name in type(self).model_fields:
            ours, theirs = getattr(self, name), getattr(other, name)
            if ours != theirs:
                lines.append(f"{name}: ours {show(ours)}, peer {show(theirs)}")
        return lines


class KvxferdConfig(BaseModel):
    """A whole kvxferd configuration: the three sections of one file.

    Every section is optional; an empty file is all defaults. `source` names the
    file it came from (it is not a YAML key).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    cache_transceiver_config: CacheTransceiverConfig = Field(
        default_factory=CacheTransceiverConfig,
        description="The seed's cache transceiver settings.",
    )
    engine: EngineSection = Field(
        default_factory=EngineSection,
        description="Static facts about the engine this daemon serves.",
    )
    daemon: DaemonSection = Field(
        default_factory=DaemonSection,
        description="The daemon's identity, addresses and timers.",
    )

    _source: str = PrivateAttr(default="<defaults>")
    # kvxferd path prefix -> the path the value has in the source file, for files
    # (TensorRT-LLM ones) whose layout differs from kvxferd's.
    _paths: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def source(self) -> str:
        """The file (or other origin) this configuration was read from."""
        return self._source

    def with_source(self, source: str, paths: Mapping[str, str] | None = None) -> KvxferdConfig:
        """A copy that names `source` as its origin (and maps paths into it)."""
        copy = self.model_copy()
        copy._source = source
        copy._paths = dict(paths or {})
        return copy

    def yaml_path(self, path: str) -> str:
        """Where the kvxferd setting `path` (e.g. "engine.scheduling") lives in the source.

        The same path for a kvxferd file; for a TensorRT-LLM file, the key it was
        read from, or "<path> (kvxferd default)" when that file cannot set it.
        """
        if not self._paths:
            return path
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):
            mapped = self._paths.get(".".join(parts[:cut]))
            if mapped is not None:
                return ".".join([mapped, *parts[cut:]])
        return f"{path} (kvxferd default)"

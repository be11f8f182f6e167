"""Read one role's settings out of a TensorRT-LLM disaggregated-serving YAML.

Such a file (what `trtllm-serve disaggregated -c` takes) has `context_servers:`
and/or `generation_servers:` at top level. kvxferd reads, for the chosen role:

* `cache_transceiver_config` -> validated as kvxferd's section (unknown keys are
  errors, as they are in TensorRT-LLM);
* `tensor_parallel_size`, `pipeline_parallel_size`, `context_parallel_size`,
  `enable_chunked_prefill`, `max_seq_len`, `max_beam_width` -> `engine:`;
* `kv_cache_config.enable_block_reuse` (TensorRT-LLM default true) and
  `kv_cache_config.block_reuse_config.policy` (default all_reusable) ->
  `engine.block_reuse`: "disabled" when reuse is off, else the policy name;
* `kv_cache_config.tokens_per_block` and `kv_cache_config.dtype` (when it names a
  dtype kvxferd knows) -> `engine.kv_layout`;
* top-level `schedule_style` (TensorRT-LLM default context_first) ->
  `engine.scheduling`.

Like TensorRT-LLM, a key set at top level applies to both sections unless the
section sets it too, and a different value in both places is an error. Every
other key (hostname, port, backend, model, num_instances, urls, ...) means
nothing to kvxferd and is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvxferd.config.diagnostics import Loc, show

SERVER_KEYS: dict[str, str] = {"context": "context_servers", "generation": "generation_servers"}
ENGINE_KEYS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "context_parallel_size",
    "enable_chunked_prefill",
    "max_seq_len",
    "max_beam_width",
)
KVXFERD_ONLY_SECTIONS = ("engine", "daemon")
_SCHEDULE_STYLES = {"context_first": "context-first", "generation_first": "generation-first"}
_DTYPES = {
    "fp8": "float8",
    "float8": "float8",
    "int8": "int8",
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
}


def is_disagg_file(data: Mapping[object, object]) -> bool:
    """True when the top level is a TensorRT-LLM disaggregated-serving config."""
    return any(key in data for key in SERVER_KEYS.values())


def roles_present(data: Mapping[object, object]) -> list[str]:
    return [role for role, key in SERVER_KEYS.items() if key in data]


@dataclass
class RoleMapping:
    """One role's settings in kvxferd's shape, and where each came from."""

    native: dict[str, object] = field(default_factory=dict)
    # kvxferd location prefix -> location in the file
    prefixes: dict[Loc, Loc] = field(default_factory=dict)
    problems: list[tuple[Loc, str]] = field(default_factory=list)

    def to_file(self, loc: Loc) -> Loc | None:
        for cut in range(len(loc), 0, -1):
            prefix = self.prefixes.get(loc[:cut])
            if prefix is not None:
                return (*prefix, *loc[cut:])
        return None


def map_role(data: Mapping[object, object], role: str) -> RoleMapping:
    """The kvxferd settings of `role` ("context" or "generation") in a disagg file."""
    out = RoleMapping()
    sec_key = SERVER_KEYS[role]
    for key in KVXFERD_ONLY_SECTIONS:
        if key in data:
            out.problems.append(
                (
                    (key,),
                    f"kvxferd's {key}: section cannot appear in a TensorRT-LLM disaggregated "
                    "file (TensorRT-LLM would pass it to both servers); write a kvxferd "
                    "configuration file instead",
                )
            )
    if sec_key not in data:
        present = ", ".join(SERVER_KEYS[r] for r in roles_present(data))
        out.problems.append(
            ((), f"has no {sec_key}: section to read the {role} role from (it has {present})")
        )
        return out
    section = data[sec_key] if data[sec_key] is not None else {}
    if not isinstance(section, Mapping):
        out.problems.append(
            ((sec_key,), f"must be a mapping of server settings (got {show(section)})")
        )
        return out

    def pick(key: str) -> tuple[object, Loc] | None:
        if key in section:
            if key in data and data[key] != section[key]:
                out.problems.append(
                    (
                        (sec_key, key),
                        f"differs from the top-level {key}: (TensorRT-LLM refuses a key set "
                        "at top level and in a server section with different values)",
                    )
                )
            return section[key], (sec_key, key)
        if key in data:
            return data[key], (key,)
        return None

    engine: dict[str, object] = {"role": role}
    out.prefixes[("engine", "role")] = (sec_key,)
    for key in ENGINE_KEYS:
        got = pick(key)
        if got is not None:
            engine[key] = got[0]
            out.prefixes[("engine", key)] = got[1]

    style = data.get("schedule_style", "context_first")
    out.prefixes[("engine", "scheduling")] = ("schedule_style",)
    if style in _SCHEDULE_STYLES:
        engine["scheduling"] = _SCHEDULE_STYLES[str(style)]
    else:
        out.problems.append(
            (
                ("schedule_style",),
                f"must be 'context_first' or 'generation_first' (got {show(style)})",
            )
        )

    # TensorRT-LLM's defaults: reuse on, policy all_reusable.
    engine["block_reuse"] = "all_reusable"
    out.prefixes[("engine", "block_reuse")] = (sec_key, "kv_cache_config", "enable_block_reuse")
    kvc = pick("kv_cache_config")
    if kvc is not None and kvc[0] is not None:
        _map_kv_cache_config(kvc[0], kvc[1], engine, out)

    out.native["engine"] = engine
    out.native["daemon"] = {"name": f"kvxferd-{role}"}
    ctc = pick("cache_transceiver_config")
    if ctc is not None:
        out.prefixes[("cache_transceiver_config",)] = ctc[1]
        if ctc[0] is not None:  # an empty section means all defaults
            out.native["cache_transceiver_config"] = ctc[0]
    return out


def _map_kv_cache_config(
    kvc: object, loc: Loc, engine: dict[str, object], out: RoleMapping
) -> None:
    if not isinstance(kvc, Mapping):
        out.problems.append((loc, f"must be a mapping (got {show(kvc)})"))
        return
    enabled = kvc.get("enable_block_reuse", True)
    if not isinstance(enabled, bool):
        out.problems.append(
            ((*loc, "enable_block_reuse"), f"must be true or false (got {show(enabled)})")
        )
    elif not enabled:
        engine["block_reuse"] = "disabled"
        out.prefixes[("engine", "block_reuse")] = (*loc, "enable_block_reuse")
    else:
        brc = kvc.get("block_reuse_config")
        if brc is not None and not isinstance(brc, Mapping):
            out.problems.append(
                ((*loc, "block_reuse_config"), f"must be a mapping (got {show(brc)})")
            )
        elif isinstance(brc, Mapping) and "policy" in brc:
            engine["block_reuse"] = brc["policy"]
            out.prefixes[("engine", "block_reuse")] = (*loc, "block_reuse_config", "policy")
    layout: dict[str, object] = {}
    if "tokens_per_block" in kvc:
        layout["tokens_per_block"] = kvc["tokens_per_block"]
        out.prefixes[("engine", "kv_layout", "tokens_per_block")] = (*loc, "tokens_per_block")
    dtype = kvc.get("dtype")
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        layout["dtype"] = _DTYPES[dtype.lower()]
        out.prefixes[("engine", "kv_layout", "dtype")] = (*loc, "dtype")
    if layout:
        engine["kv_layout"] = layout

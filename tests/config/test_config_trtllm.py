"""TensorRT-LLM disaggregated-serving files, read for one role or as a pair."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvxferd.config import KvxferdConfig, load_config, load_config_text, load_disagg_pair
from kvxferd.errors import ConfigError

DISAGG = """
hostname: localhost
port: 8000
backend: pytorch
model: TinyLlama/TinyLlama-1.1B-Chat-v1.0
free_gpu_memory_fraction: 0.8
context_servers:
  num_instances: 2
  urls: ["localhost:8001", "localhost:8002"]
  tensor_parallel_size: 2
  pipeline_parallel_size: 1
  context_parallel_size: 1
  enable_chunked_prefill: true
  max_seq_len: 8192
  max_num_tokens: 8192
  disable_overlap_scheduler: true
  kv_cache_config:
    enable_block_reuse: false
    tokens_per_block: 64
    dtype: fp8
  cache_transceiver_config:
    backend: UCX
    max_tokens_in_buffer: 4096
generation_servers:
  num_instances: 1
  urls: ["localhost:8003"]
  max_beam_width: 4
  cache_transceiver_config:
    backend: DEFAULT
    transceiver_runtime: PYTHON
"""


def load(text: str, role: str | None) -> KvxferdConfig:
    return load_config_text(textwrap.dedent(text), "disagg.yaml", role)


def problems(text: str, role: str | None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(text, role)
    return info.value.problems


def test_context_role_maps_engine_keys() -> None:
    cfg = load(DISAGG, "context")
    eng = cfg.engine
    assert eng.role == "context"
    assert (eng.tensor_parallel_size, eng.pipeline_parallel_size, eng.context_parallel_size) == (
        2,
        1,
        1,
    )
    assert eng.enable_chunked_prefill is True and eng.max_seq_len == 8192
    assert eng.block_reuse == "disabled"
    assert eng.kv_layout.tokens_per_block == 64 and eng.kv_layout.dtype == "float8"
    assert eng.scheduling == "context-first"  # TensorRT-LLM's default schedule_style
    assert cfg.cache_transceiver_config.backend == "UCX"
    assert cfg.cache_transceiver_config.max_tokens_in_buffer == 4096
    assert cfg.daemon.name == "kvxferd-context"


def test_generation_role_uses_its_own_section() -> None:
    cfg = load(DISAGG, "generation")
    assert cfg.engine.role == "generation"
    assert cfg.engine.max_beam_width == 4
    assert cfg.engine.tensor_parallel_size == 1  # not inherited from the context section
    assert cfg.cache_transceiver_config.transceiver_runtime == "PYTHON"
    # TensorRT-LLM's KV cache defaults: block reuse on, policy all_reusable
    assert cfg.engine.block_reuse == "all_reusable"


def test_block_reuse_policy_is_read() -> None:
    text = """
    generation_servers:
      kv_cache_config:
        block_reuse_config: {policy: per_request}
    """
    assert load(text, "generation").engine.block_reuse == "per_request"


def test_schedule_style_maps_to_scheduling() -> None:
    text = "schedule_style: generation_first\ncontext_servers: {}\n"
    assert load(text, "context").engine.scheduling == "generation-first"
    [problem] = problems("schedule_style: gen_first\ncontext_servers: {}\n", "context")
    assert problem.startswith("disagg.yaml: schedule_style: must be 'context_first' or")


def test_top_level_keys_are_inherited_by_both_sections() -> None:
    text = """
    cache_transceiver_config: {backend: MPI}
    tensor_parallel_size: 4
    context_servers: {}
    generation_servers: {tensor_parallel_size: 4}
    """
    for role in ("context", "generation"):
        cfg = load(text, role)
        assert cfg.cache_transceiver_config.backend == "MPI"
        assert cfg.engine.tensor_parallel_size == 4


def test_conflicting_top_level_and_section_value_is_an_error() -> None:
    text = "tensor_parallel_size: 4\ncontext_servers: {tensor_parallel_size: 2}\n"
    [problem] = problems(text, "context")
    assert "context_servers.tensor_parallel_size: differs from the top-level" in problem


def test_role_is_required_for_a_disagg_file() -> None:
    [problem] = problems(DISAGG, None)
    assert "TensorRT-LLM disaggregated-serving file" in problem and "--role" in problem
    [problem] = problems(DISAGG, "both")
    assert "--role context or --role generation" in problem


def test_missing_section_for_role() -> None:
    [problem] = problems("context_servers: {}\n", "generation")
    assert "no generation_servers: section" in problem


def test_unknown_key_inside_cache_transceiver_config_is_an_error() -> None:
    text = "generation_servers:\n  cache_transceiver_config:\n    kv_transfer_timeout: 1\n"
    [problem] = problems(text, "generation")
    assert problem == (
        "disagg.yaml: generation_servers.cache_transceiver_config.kv_transfer_timeout: "
        "unknown key 'kv_transfer_timeout' (did you mean 'kv_transfer_timeout_ms'?) (line 3)"
    )


def test_value_errors_name_the_trtllm_path() -> None:
    text = """
    context_servers:
      tensor_parallel_size: 0
      kv_cache_config: {enable_block_reuse: maybe, tokens_per_block: -1}
      cache_transceiver_config: {backend: nixl}
    """
    found = problems(text, "context")
    assert any(
        p.startswith("disagg.yaml: context_servers.tensor_parallel_size: must be greater")
        for p in found
    )
    assert any(
        "context_servers.kv_cache_config.enable_block_reuse: must be true or false" in p
        for p in found
    )
    # a bad enable_block_reuse does not hide the problems of other kv_cache_config keys
    assert any(
        "context_servers.kv_cache_config.tokens_per_block: must be greater than 0" in p
        for p in found
    )
    assert any(
        "context_servers.cache_transceiver_config.backend: must be one of" in p for p in found
    )


def test_inherited_value_error_names_top_level_path() -> None:
    text = "cache_transceiver_config: {kv_transfer_timeout_ms: 0}\ncontext_servers: {}\n"
    [problem] = problems(text, "context")
    assert problem.startswith("disagg.yaml: cache_transceiver_config.kv_transfer_timeout_ms:")


def test_unrelated_keys_are_ignored() -> None:
    text = """
    whatever_new_key: 1
    context_servers:
      some_future_llm_arg: {nested: true}
      urls: 5
      kv_cache_config: {free_gpu_memory_fraction: 0.5, dtype: nvfp4}
    """
    cfg = load(text, "context")
    assert cfg.engine.kv_layout.dtype == "float16"  # dtype kvxferd does not know: default


def test_kvxferd_sections_refused_in_a_disagg_file() -> None:
    [problem] = problems("daemon: {name: x}\ncontext_servers: {}\n", "context")
    assert "daemon: kvxferd's daemon: section cannot appear" in problem


def test_duplicate_keys_only_matter_where_kvxferd_reads() -> None:
    text = "context_servers:\n  urls: [a]\n  urls: [b]\n"
    assert load(text, "context").engine.role == "context"
    text = "context_servers:\n  max_seq_len: 1\n  max_seq_len: 2\n"
    [problem] = problems(text, "context")
    assert "duplicate key 'max_seq_len' (lines 2 and 3)" in problem


def test_yaml_path_maps_back_to_the_file() -> None:
    cfg = load(DISAGG, "context")
    assert cfg.yaml_path("engine.scheduling") == "schedule_style"
    assert cfg.yaml_path("cache_transceiver_config.backend") == (
        "context_servers.cache_transceiver_config.backend"
    )
    assert cfg.yaml_path("engine.cache_kind") == "engine.cache_kind (kvxferd default)"


def test_load_disagg_pair(tmp_path: Path) -> None:
    path = tmp_path / "disagg.yaml"
    path.write_text(textwrap.dedent(DISAGG))
    ctx, gen = load_disagg_pair(path)
    assert (ctx.engine.role, gen.engine.role) == ("context", "generation")
    assert ctx.source == gen.source == str(path)
    assert load_config(path, role="generation").engine.max_beam_width == 4


def disagg_problems(tmp_path: Path, text: str, name: str = "disagg.yaml") -> list[str]:
    """What load_disagg_pair refuses a file of `text` for."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_disagg_pair(path)
    return info.value.problems


def test_load_disagg_pair_reports_both_sections(tmp_path: Path) -> None:
    text = "context_servers: {max_seq_len: 0}\ngeneration_servers: {max_beam_width: 0}\n"
    assert len(disagg_problems(tmp_path, text)) == 2


def test_load_disagg_pair_needs_both_sections(tmp_path: Path) -> None:
    problems = disagg_problems(tmp_path, "context_servers: {}\n")
    assert "no generation_servers: section" in problems[0]


def test_load_disagg_pair_refuses_kvxferd_file(tmp_path: Path) -> None:
    problems = disagg_problems(tmp_path, "engine: {}\n", name="k.yaml")
    assert "not a TensorRT-LLM disaggregated-serving file" in problems[0]

"""enable_pipelined_transfer: one test per static requirement of the seed.

Each test starts from a configuration where every requirement holds, breaks
exactly one, and checks that exactly one problem names it.
"""

from __future__ import annotations

import pytest

from kvxferd.config import KvxferdConfig, load_config_text, resolve
from kvxferd.errors import ConfigError

GOOD = {
    "cache_transceiver_config": {
        "backend": "NIXL",
        "transceiver_runtime": "PYTHON",
        "kv_transfer_timeout_ms": 60000,
        "kv_cache_bounce_size_mb": 0,
        "enable_pipelined_transfer": True,
    },
    "engine": {
        "scheduling": "generation-first",
        "enable_chunked_prefill": True,
        "pipeline_parallel_size": 1,
        "context_parallel_size": 1,
        "max_beam_width": 1,
        "cache_kind": "standard",
        "block_reuse": "disabled",
    },
}


def build(section: str, **changes: object) -> KvxferdConfig:
    data = {name: dict(values) for name, values in GOOD.items()}
    data[section].update(changes)
    return KvxferdConfig.model_validate(data).with_source("p.yaml")


def only_problem(cfg: KvxferdConfig) -> str:
    with pytest.raises(ConfigError) as info:
        resolve(cfg)
    [problem] = info.value.problems
    assert "pipelined transfer (enable_pipelined_transfer: true)" in problem
    return problem


def test_all_requirements_hold() -> None:
    settings = resolve(build("engine"))
    assert settings.pipelined_transfer is True
    assert settings.pipelined_reason.startswith("on:")


@pytest.mark.parametrize("block_reuse", ["disabled", "all_reusable"])
def test_allowed_block_reuse_policies(block_reuse: str) -> None:
    assert resolve(build("engine", block_reuse=block_reuse)).pipelined_transfer


def test_off_by_default() -> None:
    settings = resolve(build("cache_transceiver_config", enable_pipelined_transfer=False))
    assert settings.pipelined_transfer is False and settings.pipelined_reason.startswith("off")


def test_requires_python_runtime() -> None:
    problem = only_problem(build("cache_transceiver_config", transceiver_runtime="CPP"))
    assert "p.yaml: cache_transceiver_config.transceiver_runtime:" in problem
    assert "needs the PYTHON runtime over NIXL (effective: CPP over NIXL)" in problem


def test_requires_nixl_backend_under_auto() -> None:
    # auto falls back to CPP for UCX: the one failing requirement is PYTHON over NIXL
    cfg = build("cache_transceiver_config", transceiver_runtime="auto", backend="UCX")
    assert "(effective: CPP over UCX)" in only_problem(cfg)


# A requirement of pipelined transfer broken by one setting: (section, setting, value, what
# the problem says besides naming the setting).
BROKEN_BY_ONE_SETTING = [
    pytest.param("engine", "scheduling", "context-first", "generation-first", id="scheduling"),
    pytest.param(
        "engine", "enable_chunked_prefill", False, "needs chunked prefill", id="chunked_prefill"
    ),
    pytest.param("engine", "pipeline_parallel_size", 2, "(got 2)", id="pipeline_parallel_1"),
    pytest.param("engine", "context_parallel_size", 4, "(got 4)", id="context_parallel_1"),
    pytest.param("engine", "max_beam_width", 2, "needs max_beam_width 1", id="beam_width_1"),
    pytest.param(
        "cache_transceiver_config", "kv_cache_bounce_size_mb", 16, "(got 16)", id="no_bounce"
    ),
    pytest.param("engine", "cache_kind", "mamba-hybrid", "Mamba/hybrid", id="no_mamba_hybrid"),
]


@pytest.mark.parametrize(("section", "setting", "value", "says"), BROKEN_BY_ONE_SETTING)
def test_requires(section: str, setting: str, value: object, says: str) -> None:
    problem = only_problem(build(section, **{setting: value}))
    assert f"{section}.{setting}:" in problem and says in problem


def test_mla_cache_is_fine() -> None:
    assert resolve(build("engine", cache_kind="mla")).pipelined_transfer


@pytest.mark.parametrize("policy", ["per_request", "per_conversation", "enabled"])
def test_requires_block_reuse_disabled_or_all_reusable(policy: str) -> None:
    problem = only_problem(build("engine", block_reuse=policy))
    assert "engine.block_reuse:" in problem and f"(got {policy!r})" in problem


def test_one_line_per_failing_requirement() -> None:
    cfg = KvxferdConfig.model_validate(
        {
            "cache_transceiver_config": {
                "enable_pipelined_transfer": True,
                "transceiver_runtime": "CPP",
                "kv_cache_bounce_size_mb": 1,
            },
            "engine": {
                "scheduling": "context-first",
                "pipeline_parallel_size": 2,
                "context_parallel_size": 2,
                "max_beam_width": 2,
                "cache_kind": "mamba-hybrid",
                "block_reuse": "per_request",
            },
        }
    )
    with pytest.raises(ConfigError) as info:
        resolve(cfg)
    assert len(info.value.problems) == 9  # every requirement, chunked prefill included


def test_trtllm_file_requirements_name_trtllm_keys() -> None:
    text = """
context_servers:
  enable_chunked_prefill: true
  kv_cache_config: {block_reuse_config: {policy: per_request}}
  cache_transceiver_config: {enable_pipelined_transfer: true}
"""
    with pytest.raises(ConfigError) as info:
        resolve(load_config_text(text, "d.yaml", role="context"))
    found = info.value.problems
    assert len(found) == 2
    assert any(p.startswith("d.yaml: schedule_style: pipelined transfer") for p in found)
    assert any(
        p.startswith("d.yaml: context_servers.kv_cache_config.block_reuse_config.policy:")
        for p in found
    )

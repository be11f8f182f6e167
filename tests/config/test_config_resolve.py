"""Resolution: each of the seed's rules, its outcome and its message."""

from __future__ import annotations

import json
import logging
import textwrap

import pytest
from config_harness import JSON_KEYS

from kvxferd.config import KvxferdConfig, ResolvedSettings, load_config_text, resolve
from kvxferd.errors import ConfigError


def cfg(ctc: str = "", engine: str = "") -> KvxferdConfig:
    text = "cache_transceiver_config:\n" + textwrap.indent(textwrap.dedent(ctc), "  ") + "\n"
    text += "engine:\n" + textwrap.indent(textwrap.dedent(engine), "  ") + "\n"
    return load_config_text(text, "r.yaml")


def settle(ctc: str = "", engine: str = "") -> ResolvedSettings:
    return resolve(cfg(ctc, engine))


def failures(ctc: str = "", engine: str = "") -> list[str]:
    with pytest.raises(ConfigError) as info:
        settle(ctc, engine)
    return info.value.problems


# ------------------------------------------------------------- backend


@pytest.mark.parametrize(("given", "effective"), [("null", "NIXL"), ("DEFAULT", "NIXL")])
def test_default_or_null_backend_means_nixl(given: str, effective: str) -> None:
    settings = settle(f"backend: {given}")
    assert settings.backend == effective
    assert "NIXL" in settings.backend_reason


@pytest.mark.parametrize("backend", ["UCX", "MPI", "MOONCAKE", "NIXL"])
def test_named_backend_kept(backend: str) -> None:
    assert settle(f"backend: {backend}\ntransceiver_runtime: CPP").backend == backend


# ------------------------------------------------------------- runtime


def test_null_runtime_means_cpp() -> None:
    settings = settle("transceiver_runtime: null")
    assert settings.runtime == "CPP" and "null, which means CPP" in settings.runtime_reason


def test_explicit_cpp() -> None:
    assert settle("transceiver_runtime: CPP").runtime == "CPP"


def test_explicit_python_with_nixl() -> None:
    assert settle("transceiver_runtime: PYTHON\nbackend: NIXL").runtime == "PYTHON"


def test_auto_without_preference_selects_python() -> None:
    settings = settle("transceiver_runtime: auto")
    assert settings.runtime == "PYTHON"
    assert "no engine preference" in settings.runtime_reason


@pytest.mark.parametrize("preferred", ["CPP", "PYTHON"])
def test_auto_adopts_engine_preference(preferred: str) -> None:
    settings = settle("transceiver_runtime: auto", f"preferred_transceiver_runtime: {preferred}")
    assert settings.runtime == preferred
    assert "preferred runtime" in settings.runtime_reason


def test_auto_preference_cpp_wins_even_when_python_would_work() -> None:
    assert settle("backend: NIXL", "preferred_transceiver_runtime: CPP").runtime == "CPP"


@pytest.mark.parametrize(
    ("ctc", "cause"),
    [
        ("backend: UCX", "the backend is UCX, not NIXL"),
        ("backend: MOONCAKE", "the backend is MOONCAKE, not NIXL"),
        ("kv_transfer_timeout_ms: null", "kv_transfer_timeout_ms is null"),
    ],
)
def test_auto_falls_back_to_cpp_when_config_rules_python_out(
    ctc: str, cause: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvxferd.config"):
        settings = settle(ctc)
    assert settings.runtime == "CPP"
    assert "falling back to CPP" in settings.runtime_reason and cause in settings.runtime_reason
    assert "decided on each server independently" in settings.runtime_reason
    [record] = [r for r in caplog.records if r.name == "kvxferd.config"]
    assert record.levelno == logging.WARNING and "falling back to CPP" in record.getMessage()
    assert any("falling back" in n for n in settings.notes)


def test_auto_fallback_names_both_causes() -> None:
    reason = settle("backend: MPI\nkv_transfer_timeout_ms: null").runtime_reason
    assert "MPI" in reason and "kv_transfer_timeout_ms is null" in reason


def test_no_warning_without_fallback(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvxferd.config"):
        settle("transceiver_runtime: auto")
    assert not [r for r in caplog.records if r.name == "kvxferd.config"]


def test_explicit_python_with_non_nixl_backend_fails() -> None:
    [problem] = failures("transceiver_runtime: PYTHON\nbackend: UCX")
    assert problem.startswith("r.yaml: cache_transceiver_config.backend: ")
    assert "the backend is UCX, not NIXL" in problem
    assert "because transceiver_runtime is PYTHON" in problem


def test_explicit_python_with_null_timeout_fails() -> None:
    [problem] = failures("transceiver_runtime: PYTHON\nkv_transfer_timeout_ms: null")
    assert problem.startswith("r.yaml: cache_transceiver_config.kv_transfer_timeout_ms: ")
    assert "finite kv_transfer_timeout_ms" in problem


def test_explicit_python_reports_both_blockers() -> None:
    assert (
        len(failures("transceiver_runtime: PYTHON\nbackend: MPI\nkv_transfer_timeout_ms: null"))
        == 2
    )


def test_engine_preferred_python_is_not_a_fallback_but_an_error() -> None:
    [problem] = failures("backend: UCX", "preferred_transceiver_runtime: PYTHON")
    assert "engine declares PYTHON as its preferred runtime" in problem


def test_cpp_accepts_null_timeout_and_any_backend() -> None:
    settings = settle("transceiver_runtime: CPP\nbackend: MPI\nkv_transfer_timeout_ms: null")
    assert (settings.runtime, settings.kv_transfer_timeout_ms) == ("CPP", None)


# ------------------------------------------------------------- bounce


def test_bounce_off_by_default() -> None:
    settings = settle()
    assert settings.bounce_buffer_mb == 0 and settings.bounce_reason.startswith("off")


def test_bounce_on_with_python() -> None:
    settings = settle("transceiver_runtime: PYTHON\nkv_cache_bounce_size_mb: 64")
    assert settings.bounce_buffer_mb == 64 and settings.bounce_reason.startswith("on: 64 MiB")


def test_bounce_with_cpp_is_unused_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvxferd.config"):
        settings = settle("transceiver_runtime: CPP\nkv_cache_bounce_size_mb: 64")
    assert settings.bounce_buffer_mb == 0
    assert settings.bounce_reason.startswith("unused")
    [note] = settings.notes
    assert note.startswith("r.yaml: cache_transceiver_config.kv_cache_bounce_size_mb: unused")
    assert any("unused" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------- buffer and admission


@pytest.mark.parametrize(
    ("tokens", "per_block", "window"),
    [(32, 32, 1), (4096, 32, 128), (4096, 64, 64), (48, 16, 3)],
)
def test_admission_window_in_blocks(tokens: int, per_block: int, window: int) -> None:
    settings = settle(
        f"max_tokens_in_buffer: {tokens}", f"kv_layout: {{tokens_per_block: {per_block}}}"
    )
    assert settings.admission_window_blocks == window
    assert settings.max_tokens_in_buffer == tokens


def test_no_admission_window_when_unset() -> None:
    assert settle().admission_window_blocks is None


@pytest.mark.parametrize(("tokens", "nearest"), [(100, "96, 128"), (0, "32"), (-64, "32")])
def test_max_tokens_must_be_positive_multiple(tokens: int, nearest: str) -> None:
    [problem] = failures(f"max_tokens_in_buffer: {tokens}")
    assert problem.startswith("r.yaml: cache_transceiver_config.max_tokens_in_buffer: ")
    assert "positive multiple of tokens_per_block (32" in problem
    assert f"got {tokens}; nearest valid: {nearest}" in problem


def test_max_tokens_rule_applies_to_cpp_too() -> None:
    assert failures("transceiver_runtime: CPP\nmax_tokens_in_buffer: 33")


# ------------------------------------------------------------- all problems at once


def test_all_problems_collected() -> None:
    found = failures(
        "transceiver_runtime: PYTHON\nbackend: UCX\nmax_tokens_in_buffer: 7\n"
        "enable_pipelined_transfer: true",
        "pipeline_parallel_size: 2",
    )
    assert len(found) == 5  # backend, runtime/NIXL, chunked prefill, pp, max_tokens


# ------------------------------------------------------------- settings object


def test_timeouts_pass_through() -> None:
    settings = settle(
        "kv_transfer_timeout_ms: 7\nkv_transfer_sender_future_timeout_ms: null\n"
        "kv_transfer_poll_interval_ms: 9"
    )
    assert settings.kv_transfer_timeout_ms == 7
    assert settings.kv_transfer_sender_future_timeout_ms is None
    assert settings.kv_transfer_poll_interval_ms == 9


def test_to_json_dict_is_json_and_complete() -> None:
    data = settle("max_tokens_in_buffer: 64").to_json_dict()
    assert set(data) >= JSON_KEYS
    assert json.loads(json.dumps(data)) == data
    assert data["admission_window_blocks"] == 2 and data["fingerprint"]


def test_fingerprint_covers_exactly_the_peer_compat_fields() -> None:
    base = settle("backend: NIXL")
    assert base.peer_compat_fields() == {
        "backend": "NIXL",
        "runtime": "PYTHON",
        "pipelined_transfer": False,
    }
    assert len(base.fingerprint()) == 16 and int(base.fingerprint(), 16) >= 0
    # settings the peers need not share leave it alone
    assert settle("backend: DEFAULT\nkv_transfer_timeout_ms: 5").fingerprint() == base.fingerprint()
    # each compat field changes it
    assert settle("backend: NIXL\ntransceiver_runtime: CPP").fingerprint() != base.fingerprint()
    assert (
        settle("backend: UCX\ntransceiver_runtime: CPP").fingerprint()
        != settle("backend: NIXL\ntransceiver_runtime: CPP").fingerprint()
    )
    pipelined = settle(
        "enable_pipelined_transfer: true", "enable_chunked_prefill: true"
    ).fingerprint()
    assert pipelined != base.fingerprint()


def test_settings_are_frozen() -> None:
    settings = settle()
    with pytest.raises(AttributeError):
        settings.runtime = "CPP"  # type: ignore[misc]

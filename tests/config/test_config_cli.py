"""`kvxferd config validate|explain`: exit codes and what lands on stdout and stderr."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from cli_harness import kvxferd
from config_harness import JSON_KEYS

from kvxferd.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
REPO = CONFIGS.parent


def write(tmp_path: Path, text: str, name: str = "k.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("kvxferd: error: ")]


# ------------------------------------------------------------- validate


def test_validate_ok_prints_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "config", "validate", str(CONFIGS / "context.yaml"))
    assert code == 0
    assert out.count("\n") == 1 and "valid" in out
    assert "NIXL backend, PYTHON runtime" in out and "admission window 256 blocks" in out
    assert err == ""


def test_validate_reports_each_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(
        tmp_path,
        """
        cache_transceiver_config:
          kv_transfer_timeout_ms: -5
          kv_transfer_timeout: 3
        engine:
          dtype: float8
        """,
    )
    code, out, err = run(capsys, "config", "validate", path)
    assert code == 2 and out == ""
    lines = error_lines(err)
    assert len(lines) == 3
    assert (
        f"{path}: cache_transceiver_config.kv_transfer_timeout_ms: must be greater than 0 "
        "(got -5)" in lines[0]
    )
    assert "did you mean 'kv_transfer_timeout_ms'?" in lines[1]
    assert "write it as engine.kv_layout.dtype" in lines[2]


def test_validate_yaml_syntax_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "engine:\n  role: [context\n")
    code, _, err = run(capsys, "config", "validate", path)
    [line] = error_lines(err)
    assert code == 2 and "YAML syntax error at line" in line and "column" in line


def test_validate_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "config", "validate", str(tmp_path / "nope.yaml"))
    assert code == 2 and "cannot read the configuration file" in err


def test_validate_resolution_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(
        tmp_path, "cache_transceiver_config: {transceiver_runtime: PYTHON, backend: UCX}\n"
    )
    code, out, err = run(capsys, "config", "validate", path)
    assert code == 2 and out == ""
    [line] = error_lines(err)
    assert "cache_transceiver_config.backend" in line and "not NIXL" in line


def test_validate_warns_about_fallback_but_succeeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "cache_transceiver_config: {backend: UCX}\n")
    code, out, err = run(capsys, "config", "validate", path)
    assert code == 0 and "CPP runtime" in out
    assert "kvxferd: warning: " in err and "falling back to CPP" in err


def test_validate_role_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "config", "validate", str(CONFIGS / "context.yaml"), "--role", "generation"
    )
    assert code == 0 and "role generation" in out


def test_validate_rejects_unknown_role(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["config", "validate", str(CONFIGS / "context.yaml"), "--role", "prefill"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# ------------------------------------------------------------- TensorRT-LLM files

MISMATCHED = """
context_servers:
  cache_transceiver_config: {backend: UCX}
generation_servers:
  cache_transceiver_config: {backend: NIXL}
"""


def test_validate_trtllm_pair_ok(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "config", "validate", str(CONFIGS / "trtllm-disagg.yaml"))
    assert code == 0 and err == ""
    assert "context: role context" in out and "generation: role generation" in out


def test_validate_trtllm_mismatch_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, MISMATCHED)
    code, out, err = run(capsys, "config", "validate", path)
    assert code == 2 and out == ""
    lines = error_lines(err)
    assert any(
        "disagree on the effective backend: context UCX, generation NIXL" in x for x in lines
    )
    assert any(
        "disagree on the effective runtime: context CPP, generation PYTHON" in x for x in lines
    )
    assert len(lines) == 2


def test_validate_trtllm_pipelining_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path,
        """
        schedule_style: generation_first
        enable_chunked_prefill: true
        context_servers:
          cache_transceiver_config: {enable_pipelined_transfer: true}
        generation_servers: {}
        """,
    )
    code, _, err = run(capsys, "config", "validate", path)
    assert code == 2 and "disagree on the effective pipelined_transfer" in err


def test_validate_trtllm_each_role(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, MISMATCHED)
    assert run(capsys, "config", "validate", path, "--role", "context")[0] == 0
    code, out, _ = run(capsys, "config", "validate", path, "--role", "generation")
    assert code == 0 and "NIXL backend, PYTHON runtime" in out


def test_validate_trtllm_section_errors_name_role(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path,
        """
        context_servers:
          cache_transceiver_config: {bakend: UCX}
        generation_servers:
          cache_transceiver_config: {max_tokens_in_buffer: 10}
        """,
    )
    code, _, err = run(capsys, "config", "validate", path)
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1  # the context role stops at the unknown key
    assert "context_servers.cache_transceiver_config.bakend" in lines[0]
    assert "(did you mean 'backend'?)" in lines[0]


def test_explain_trtllm_needs_role(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "config", "explain", str(CONFIGS / "trtllm-disagg.yaml"))
    assert code == 2 and "--role" in err


# ------------------------------------------------------------- explain


def test_explain_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "config", "explain", str(CONFIGS / "context.yaml"))
    assert code == 0
    assert "backend:            NIXL" in out
    assert "runtime:            PYTHON (transceiver_runtime is PYTHON)" in out
    for name in (
        "kv_transfer_timeout_ms = 60000 ms",
        "kv_transfer_sender_future_timeout_ms = 1000 ms",
        "kv_transfer_poll_interval_ms = 5000 ms",
    ):
        assert name in out
    assert "absolute deadline" in out and "does not set the overall transfer deadline" in out
    assert "bounce buffer:      off" in out
    assert "pipelined transfer: off" in out
    assert "admission window:   256 blocks" in out


def test_explain_shows_fallback_and_unused_bounce(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "cache_transceiver_config: {backend: UCX, kv_cache_bounce_size_mb: 8}\n")
    code, out, err = run(capsys, "config", "explain", path)
    assert code == 0
    assert "runtime:            CPP" in out and "falling back to CPP" in out
    assert "bounce buffer:      unused" in out
    assert "unused" in err  # also logged as a warning


def test_explain_pipelined_on(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "config", "explain", str(CONFIGS / "pipelined.yaml"))
    assert code == 0 and "pipelined transfer: on:" in out


def test_explain_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "config", "explain", "--json", str(CONFIGS / "staged-ucx.yaml"))
    assert code == 0
    data = json.loads(out)  # one object and nothing else on stdout
    assert set(data) >= JSON_KEYS
    assert data["backend"] == "UCX" and data["runtime"] == "CPP"
    assert data["admission_window_blocks"] == 64 and data["max_tokens_in_buffer"] == 4096
    assert data["kv_transfer_timeout_ms"] == 120000
    assert data["pipelined_transfer"] is False and data["bounce_buffer_mb"] == 0


def test_explain_json_trtllm_role(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "config",
        "explain",
        "--json",
        "--role",
        "generation",
        str(CONFIGS / "trtllm-disagg.yaml"),
    )
    data = json.loads(out)
    assert code == 0 and data["role"] == "generation" and data["admission_window_blocks"] == 128


def test_explain_error_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "cache_transceiver_config: {max_tokens_in_buffer: 33}\n")
    code, out, err = run(capsys, "config", "explain", "--json", path)
    assert code == 2 and out == "" and "positive multiple of tokens_per_block" in err


def test_config_without_action_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "config")
    assert code == 2 and "validate" in err


# ------------------------------------------------------------- the real entry point


def test_entry_point_subprocess(tmp_path: Path) -> None:
    bad = write(tmp_path, "cache_transceiver_config: {backend: nixl}\n")
    result = kvxferd("config", "validate", bad, cwd=str(REPO), timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(f"kvxferd: error: {bad}: cache_transceiver_config.backend:")
    assert "did you mean 'NIXL'?" in result.stderr


def test_explain_null_timeouts_say_what_null_means(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path,
        """
        cache_transceiver_config:
          transceiver_runtime: CPP
          kv_transfer_timeout_ms: null
          kv_transfer_sender_future_timeout_ms: null
          kv_transfer_poll_interval_ms: null
        """,
    )
    code, out, _ = run(capsys, "config", "explain", path)
    assert code == 0
    assert "kv_transfer_timeout_ms = null" in out and "no transfer deadline" in out
    assert "without slicing" in out
    assert "only when an in-flight transfer finishes" in out

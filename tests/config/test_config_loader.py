"""Loading kvxferd YAML files: what is accepted, and how each mistake is reported."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvxferd.config import CacheTransceiverConfig, KvxferdConfig, load_config, load_config_text
from kvxferd.errors import ConfigError


def load(text: str, role: str | None = None) -> KvxferdConfig:
    return load_config_text(textwrap.dedent(text), "ctx.yaml", role)


def problems(text: str, role: str | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(text, role)
    assert info.value.problems, "a ConfigError must carry at least one problem"
    return info.value.problems


# ------------------------------------------------------------- what is accepted


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
def test_empty_file_is_all_defaults(text: str) -> None:
    cfg = load(text)
    assert cfg.model_dump() == KvxferdConfig().model_dump()
    assert cfg.source == "ctx.yaml"


def test_only_cache_transceiver_section_is_valid() -> None:
    cfg = load(
        """
        cache_transceiver_config:
          backend: UCX
          kv_transfer_timeout_ms: null
        """
    )
    assert cfg.cache_transceiver_config == CacheTransceiverConfig(
        backend="UCX", kv_transfer_timeout_ms=None
    )
    assert cfg.engine.role == "both" and cfg.daemon.name == "kvxferd"


@pytest.mark.parametrize("section", ["cache_transceiver_config", "engine", "daemon"])
def test_empty_section_means_defaults(section: str) -> None:
    assert load(f"{section}:\n").model_dump() == KvxferdConfig().model_dump()


def test_empty_kv_layout_means_defaults() -> None:
    assert load("engine:\n  kv_layout:\n").engine.kv_layout.tokens_per_block == 32


def test_full_file_values_arrive() -> None:
    cfg = load(
        """
        cache_transceiver_config: {backend: MPI, transceiver_runtime: null}
        engine:
          role: generation
          kv_layout: {tokens_per_block: 64, dtype: int8, layout: layer-major}
          max_seq_len: 4096
        daemon:
          name: gen0
          peers: {ctx0: "10.0.0.1:47400"}
          http: null
          log_level: DEBUG
        """
    )
    assert cfg.cache_transceiver_config.backend == "MPI"
    assert cfg.cache_transceiver_config.transceiver_runtime is None
    assert cfg.engine.kv_layout.tokens_per_block == 64 and cfg.engine.kv_layout.itemsize == 1
    assert cfg.daemon.peers == {"ctx0": "10.0.0.1:47400"} and cfg.daemon.http is None


@pytest.mark.parametrize("role", ["context", "generation", "both"])
def test_role_overrides_engine_role(role: str) -> None:
    assert load("engine: {role: generation}\n", role=role).engine.role == role


def test_invalid_role_rejected() -> None:
    assert "role must be one of" in problems("", role="prefill")[0]


def test_load_config_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "ctx.yaml"
    path.write_text("cache_transceiver_config: {backend: UCX}\n")
    cfg = load_config(path)
    assert cfg.cache_transceiver_config.backend == "UCX"
    assert cfg.source == str(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.yaml")
    assert "absent.yaml" in info.value.problems[0] and "cannot read" in info.value.problems[0]


# ------------------------------------------------------------- shared secret


def test_shared_secret_relative_to_config_file(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("abc\n")
    (tmp_path / "d.yaml").write_text("daemon: {shared_secret_file: secret}\n")
    cfg = load_config(tmp_path / "d.yaml")
    assert cfg.daemon.shared_secret_file == str(tmp_path / "secret")
    assert cfg.daemon.read_shared_secret() == b"abc"


@pytest.mark.parametrize("content", [None, "", "\n  \n"])
def test_unreadable_or_empty_secret_fails_at_load(tmp_path: Path, content: str | None) -> None:
    secret = tmp_path / "secret"
    if content is not None:
        secret.write_text(content)
    (tmp_path / "d.yaml").write_text(f"daemon:\n  shared_secret_file: {secret}\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "d.yaml")
    [problem] = info.value.problems
    assert problem.startswith(f"{tmp_path / 'd.yaml'}: daemon.shared_secret_file: ")
    assert str(secret) in problem and "(line 2)" in problem


# ------------------------------------------------------------- YAML syntax


def one_problem(text: str, *needles: str) -> None:
    """`text` fails to load with exactly one problem, which holds every one of `needles`."""
    [problem] = problems(text)
    for needle in needles:
        assert needle in problem, (needle, problem)


def test_syntax_error_names_line_and_column() -> None:
    [problem] = problems("cache_transceiver_config:\n  backend: NIXL\n bad: [1,\n")
    assert problem.startswith("ctx.yaml: YAML syntax error at line ")
    assert "column" in problem


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        pytest.param("a: 1\nb: : 2\n", ["line 2, column 4"], id="position_is_exact"),
        pytest.param("engine:\n\trole: context\n", ["line 2"], id="tab_indentation"),
        pytest.param(
            "engine: !!python/object/apply:os.system ['true']\n",
            ["YAML syntax error", "line 1"],
            id="python_tags_are_refused",
        ),
        pytest.param(
            """
            cache_transceiver_config:
              backend: NIXL
              backend: UCX
            """,
            ["cache_transceiver_config.backend: duplicate key 'backend' (lines 3 and 4)"],
            id="duplicate_keys_are_errors",
        ),
    ],
)
def test_a_syntax_problem_names_its_place(text: str, needles: list[str]) -> None:
    one_problem(text, *needles)


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "a list"), ("42\n", "42")])
def test_top_level_must_be_a_mapping(text: str, kind: str) -> None:
    one_problem(text, "must hold a mapping", kind)


# ------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            "cache_transceiver_config:\n  kv_transfer_timeout_ms: -5\n",
            "ctx.yaml: cache_transceiver_config.kv_transfer_timeout_ms: "
            "must be greater than 0 (got -5) (line 2)",
            id="range_error_names_path_value_and_rule",
        ),
        pytest.param(
            "cache_transceiver_config:\n  kv_transfer_timeout: 5\n",
            "ctx.yaml: cache_transceiver_config.kv_transfer_timeout: unknown key "
            "'kv_transfer_timeout' (did you mean 'kv_transfer_timeout_ms'?) (line 2)",
            id="unknown_key_suggests_closest",
        ),
    ],
)
def test_the_whole_message(text: str, message: str) -> None:
    [problem] = problems(text)
    assert problem == message


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        pytest.param(
            "cache_transceiver_config: {kv_cache_bounce_size_mb: -1}\n",
            ["kv_cache_bounce_size_mb: must be greater than or equal to 0 (got -1)"],
            id="ge_error",
        ),
        pytest.param(
            "cache_transceiver_config:\n  kv_transfer_timeout_ms: '60000'\n",
            [
                "cache_transceiver_config.kv_transfer_timeout_ms: must be an integer greater ",
                "or null (got '60000', a string)",
            ],
            id="type_error_says_what_is_allowed",
        ),
        pytest.param(
            "engine: {kv_layout: {tokens_per_block: yes}}\n",
            [
                "engine.kv_layout.tokens_per_block: must be an integer greater than 0",
                "got true, a boolean",
            ],
            id="bool_for_int_is_a_type_error",
        ),
        pytest.param(
            "cache_transceiver_config: {transceiver_runtime: Auto}\n",
            [
                "must be one of 'CPP', 'PYTHON', 'auto', or null (got 'Auto')",
                "case-sensitive: did you mean 'auto'?",
            ],
            id="literal_error_lists_choices_and_case_hint",
        ),
        pytest.param(
            "engine: [context]\n",
            ["ctx.yaml: engine: must be a mapping", "got a list"],
            id="section_of_wrong_type",
        ),
        pytest.param(
            "daemon: {heartbeat_interval_ms: 5000}\n",
            ["daemon.heartbeat_timeout_ms: must be greater than heartbeat_interval_ms (5000)"],
            id="heartbeat_rule_reported_at_timeout_path",
        ),
        # unknown keys
        pytest.param(
            "daemon: {colour: blue}\n",
            ["unknown key 'colour'; allowed here: name, api_socket, peer_listen"],
            id="unknown_key_without_close_match_lists_allowed",
        ),
        pytest.param(
            "engin: {}\n",
            ["unknown top-level key 'engin' (did you mean 'engine'?)"],
            id="misspelled_section",
        ),
        # YAML's own surprises
        pytest.param(
            "daemon:\n  peer_listen: 10:20\n",  # YAML 1.1: base-60 integer
            ["daemon.peer_listen: must be a string (got 620); quote it"],
            id="unquoted_host_port_read_as_number_gets_quote_hint",
        ),
        pytest.param(
            "daemon: {name: 2024-01-01}\n",
            ["got 2024-01-01, a date); quote it"],
            id="date_for_string_gets_quote_hint",
        ),
        pytest.param(
            "daemon:\n  peers:\n    7: 'h:1'\n",
            ["daemon.peers.7: the key 7 is not a string; quote it"],
            id="non_string_peer_name",
        ),
    ],
)
def test_a_bad_value_or_key_is_one_problem_that_says_so(text: str, needles: list[str]) -> None:
    one_problem(text, *needles)


def test_every_problem_reported_at_once() -> None:
    found = problems(
        """
        cache_transceiver_config:
          backend: nixl
          kv_transfer_poll_interval_ms: 0
        engine:
          max_beam_width: 0
        daemon:
          peer_listen: nowhere
        """
    )
    assert len(found) == 4
    # in file order
    assert [p.split(": ")[1] for p in found] == [
        "cache_transceiver_config.backend",
        "cache_transceiver_config.kv_transfer_poll_interval_ms",
        "engine.max_beam_width",
        "daemon.peer_listen",
    ]


def test_peer_name_and_address_errors() -> None:
    found = problems("daemon:\n  peers:\n    'gen 0': 'h:1'\n    gen1: 'h'\n")
    assert any("daemon.peers.gen 0: name must contain only letters" in p for p in found)
    assert any("daemon.peers.gen1: must be host:port with a port from 1" in p for p in found)


# ------------------------------------------------------------- unknown keys and nesting


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        (
            "backend: NIXL\n",
            "it belongs in the cache_transceiver_config: section "
            "(write it as cache_transceiver_config.backend)",
        ),
        ("tensor_parallel_size: 2\n", "write it as engine.tensor_parallel_size"),
        ("peer_listen: 'h:1'\n", "write it as daemon.peer_listen"),
        ("engine: {tokens_per_block: 16}\n", "write it as engine.kv_layout.tokens_per_block"),
        ("daemon: {backend: UCX}\n", "write it as cache_transceiver_config.backend"),
        ("engine: {cache_transceiver_config: {}}\n", "it is a top-level section"),
        (
            "kv_transfer_timeoutms: 1\n",
            "did you mean cache_transceiver_config.kv_transfer_timeout_ms?",
        ),
    ],
)
def test_wrong_nesting_gets_a_hint(text: str, hint: str) -> None:
    [problem] = problems(text)
    assert hint in problem
    assert "unknown" in problem


# ------------------------------------------------------------- YAML's own surprises


@pytest.mark.parametrize(("text", "shown"), [("1: x\n", "the key 1"), ("on: 1\n", "the key true")])
def test_non_string_key(text: str, shown: str) -> None:
    [problem] = problems(text)
    assert f"{shown} is not a string" in problem and "quote it" in problem

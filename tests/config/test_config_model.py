"""CacheTransceiverConfig against the seed, field by field, and the other sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvxferd.config import (
    CacheTransceiverConfig,
    DaemonSection,
    EngineSection,
    KvLayoutSpec,
    KvxferdConfig,
)
from kvxferd.errors import ConfigError

# The seed's fields and defaults, copied from shared/seed/CacheTransceiverConfig.txt.
SEED_DEFAULTS: dict[str, Any] = {
    "backend": None,
    "transceiver_runtime": "auto",
    "max_tokens_in_buffer": None,
    "kv_transfer_timeout_ms": 60000,
    "kv_transfer_sender_future_timeout_ms": 1000,
    "kv_transfer_poll_interval_ms": 5000,
    "kv_cache_bounce_size_mb": 0,
    "enable_pipelined_transfer": False,
}
GT0_NULLABLE = (
    "kv_transfer_timeout_ms",
    "kv_transfer_sender_future_timeout_ms",
    "kv_transfer_poll_interval_ms",
)


def _rejects(model: type[Any], **data: Any) -> list[Any]:
    with pytest.raises(ValidationError) as info:
        model(**data)
    return [(e["type"], e["loc"]) for e in info.value.errors()]


# ------------------------------------------------------------- CacheTransceiverConfig


def test_fields_are_exactly_the_seeds_in_order() -> None:
    assert list(CacheTransceiverConfig.model_fields) == list(SEED_DEFAULTS)


@pytest.mark.parametrize(("name", "default"), SEED_DEFAULTS.items())
def test_default_matches_seed(name: str, default: Any) -> None:
    assert getattr(CacheTransceiverConfig(), name) == default


@pytest.mark.parametrize("name", SEED_DEFAULTS)
def test_every_field_documents_its_meaning(name: str) -> None:
    description = CacheTransceiverConfig.model_fields[name].description
    assert description and len(description) > 30


def test_descriptions_carry_seed_sentences() -> None:
    fields = CacheTransceiverConfig.model_fields
    assert "does not set the overall transfer" in str(
        fields["kv_transfer_sender_future_timeout_ms"].description
    )
    assert "None" not in str(fields["transceiver_runtime"].description)  # YAML says null
    assert "null is equivalent to 'CPP'" in str(fields["transceiver_runtime"].description)
    assert "Only used by the Python (v2)" in str(fields["kv_cache_bounce_size_mb"].description)


@pytest.mark.parametrize("value", ["DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI", None])
def test_backend_accepts_seed_values(value: str | None) -> None:
    assert CacheTransceiverConfig(backend=value).backend == value  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["nixl", "Nixl", "default", "TCP", "", 1])
def test_backend_is_case_sensitive_literal(value: Any) -> None:
    assert _rejects(CacheTransceiverConfig, backend=value) == [("literal_error", ("backend",))]


@pytest.mark.parametrize("value", ["CPP", "PYTHON", "auto", None])
def test_runtime_accepts_seed_values(value: str | None) -> None:
    cfg = CacheTransceiverConfig(transceiver_runtime=value)  # type: ignore[arg-type]
    assert cfg.transceiver_runtime == value


@pytest.mark.parametrize("value", ["AUTO", "cpp", "python", "Auto", "v2"])
def test_runtime_is_case_sensitive_literal(value: str) -> None:
    errors = _rejects(CacheTransceiverConfig, transceiver_runtime=value)
    assert errors == [("literal_error", ("transceiver_runtime",))]


@pytest.mark.parametrize("name", GT0_NULLABLE)
def test_timeouts_are_gt_zero_or_null(name: str) -> None:
    assert getattr(CacheTransceiverConfig.model_validate({name: None}), name) is None
    assert getattr(CacheTransceiverConfig.model_validate({name: 1}), name) == 1
    assert _rejects(CacheTransceiverConfig, **{name: 0}) == [("greater_than", (name,))]
    assert _rejects(CacheTransceiverConfig, **{name: -5}) == [("greater_than", (name,))]


def test_bounce_is_ge_zero_and_not_nullable() -> None:
    assert CacheTransceiverConfig(kv_cache_bounce_size_mb=0).kv_cache_bounce_size_mb == 0
    assert CacheTransceiverConfig(kv_cache_bounce_size_mb=1).kv_cache_bounce_size_mb == 1
    assert _rejects(CacheTransceiverConfig, kv_cache_bounce_size_mb=-1) == [
        ("greater_than_equal", ("kv_cache_bounce_size_mb",))
    ]
    assert _rejects(CacheTransceiverConfig, kv_cache_bounce_size_mb=None) == [
        ("int_type", ("kv_cache_bounce_size_mb",))
    ]


def test_max_tokens_in_buffer_is_int_or_null_without_model_constraint() -> None:
    # The seed puts no bound on it; resolution checks it against tokens_per_block.
    assert CacheTransceiverConfig(max_tokens_in_buffer=None).max_tokens_in_buffer is None
    assert CacheTransceiverConfig(max_tokens_in_buffer=100).max_tokens_in_buffer == 100
    assert _rejects(CacheTransceiverConfig, max_tokens_in_buffer=1.5) == [
        ("int_type", ("max_tokens_in_buffer",))
    ]


@pytest.mark.parametrize("value", ["true", 1, None])
def test_pipelined_flag_is_a_strict_bool(value: Any) -> None:
    assert _rejects(CacheTransceiverConfig, enable_pipelined_transfer=value) == [
        ("bool_type", ("enable_pipelined_transfer",))
    ]


@pytest.mark.parametrize("value", ["60000", True, 60000.0])
def test_integers_are_not_coerced(value: Any) -> None:
    assert _rejects(CacheTransceiverConfig, kv_transfer_timeout_ms=value) == [
        ("int_type", ("kv_transfer_timeout_ms",))
    ]


def test_unknown_key_rejected() -> None:
    assert _rejects(CacheTransceiverConfig, kv_transfer_timeout=5) == [
        ("extra_forbidden", ("kv_transfer_timeout",))
    ]


def test_model_is_frozen() -> None:
    cfg = CacheTransceiverConfig()
    with pytest.raises(ValidationError):
        cfg.backend = "UCX"  # type: ignore[misc]


def test_docstring_maps_every_mirror_method() -> None:
    doc = CacheTransceiverConfig.__doc__ or ""
    for name in (
        "from_pybind",
        "get_pybind_enum_fields",
        "get_pybind_variable_fields",
        "maybe_to_pybind",
        "mirror_pybind_enum",
        "mirror_pybind_fields",
        "pybind_equals",
    ):
        assert name in doc


# ------------------------------------------------------------- advertised / differences


def test_advertised_is_plain_and_complete() -> None:
    cfg = CacheTransceiverConfig(backend="UCX", kv_transfer_timeout_ms=None)
    data = cfg.advertised()
    assert data == {**SEED_DEFAULTS, "backend": "UCX", "kv_transfer_timeout_ms": None}
    assert CacheTransceiverConfig.from_advertised(data) == cfg


def test_from_advertised_names_unknown_keys() -> None:
    data = {**CacheTransceiverConfig().advertised(), "bounce_mb": 1, "extra": 2}
    with pytest.raises(ConfigError) as info:
        CacheTransceiverConfig.from_advertised(data)
    text = "\n".join(info.value.problems)
    assert "unknown key 'bounce_mb'" in text and "unknown key 'extra'" in text
    assert len(info.value.problems) == 2


def test_from_advertised_validates_values() -> None:
    with pytest.raises(ConfigError) as info:
        CacheTransceiverConfig.from_advertised({"backend": "nixl", "kv_transfer_timeout_ms": 0})
    assert len(info.value.problems) == 2
    assert any("backend" in p and "'nixl'" in p for p in info.value.problems)


def test_from_advertised_rejects_non_mapping() -> None:
    with pytest.raises(ConfigError):
        CacheTransceiverConfig.from_advertised(["backend"])  # type: ignore[arg-type]


def test_from_advertised_fills_missing_keys_with_defaults() -> None:
    assert (
        CacheTransceiverConfig.from_advertised({"backend": "MPI"}).kv_transfer_timeout_ms == 60000
    )


def test_differences_lists_each_field() -> None:
    ours = CacheTransceiverConfig(backend="NIXL", kv_transfer_timeout_ms=1000)
    peer = CacheTransceiverConfig(backend="UCX", kv_transfer_timeout_ms=None)
    assert ours.differences(peer) == [
        "backend: ours 'NIXL', peer 'UCX'",
        "kv_transfer_timeout_ms: ours 1000, peer null",
    ]
    assert ours.differences(ours) == []


# ------------------------------------------------------------- KvLayoutSpec


def test_layout_defaults() -> None:
    layout = KvLayoutSpec()
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (32, 8, 128)
    assert layout.tokens_per_block == 32
    assert (layout.dtype, layout.layout) == ("float16", "block-major")


@pytest.mark.parametrize(
    ("dtype", "size"),
    [("float16", 2), ("bfloat16", 2), ("float32", 4), ("float8", 1), ("int8", 1)],
)
def test_layout_itemsize(dtype: str, size: int) -> None:
    assert KvLayoutSpec.model_validate({"dtype": dtype}).itemsize == size


@pytest.mark.parametrize("name", ["num_layers", "num_kv_heads", "head_dim", "tokens_per_block"])
def test_layout_sizes_gt_zero(name: str) -> None:
    assert _rejects(KvLayoutSpec, **{name: 0}) == [("greater_than", (name,))]


def test_layout_literals() -> None:
    assert _rejects(KvLayoutSpec, dtype="fp16") == [("literal_error", ("dtype",))]
    assert _rejects(KvLayoutSpec, layout="Block-Major") == [("literal_error", ("layout",))]
    assert _rejects(KvLayoutSpec, extra=1) == [("extra_forbidden", ("extra",))]


# ------------------------------------------------------------- EngineSection


def test_engine_defaults() -> None:
    eng = EngineSection()
    assert eng.role == "both"
    assert (eng.tensor_parallel_size, eng.pipeline_parallel_size, eng.context_parallel_size) == (
        1,
        1,
        1,
    )
    assert eng.enable_chunked_prefill is False
    assert eng.scheduling == "generation-first"
    assert eng.block_reuse == "disabled"
    assert eng.max_beam_width == 1
    assert eng.cache_kind == "standard"
    assert eng.preferred_transceiver_runtime is None
    assert eng.kv_layout == KvLayoutSpec()
    assert eng.max_seq_len is None


@pytest.mark.parametrize(("kind", "factor"), [("standard", 2), ("mla", 1), ("mamba-hybrid", 2)])
def test_kv_factor(kind: str, factor: int) -> None:
    assert EngineSection.model_validate({"cache_kind": kind}).kv_factor == factor


@pytest.mark.parametrize(
    "name",
    [
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "context_parallel_size",
        "max_beam_width",
        "max_seq_len",
    ],
)
def test_engine_sizes_gt_zero(name: str) -> None:
    assert _rejects(EngineSection, **{name: 0}) == [("greater_than", (name,))]


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("role", "Context"),
        ("scheduling", "generation_first"),
        ("cache_kind", "MLA"),
        ("preferred_transceiver_runtime", "auto"),
    ],
)
def test_engine_literals(name: str, bad: str) -> None:
    assert _rejects(EngineSection, **{name: bad}) == [("literal_error", (name,))]


def test_engine_block_reuse_any_nonempty_policy() -> None:
    assert EngineSection(block_reuse="per_request").block_reuse == "per_request"
    assert _rejects(EngineSection, block_reuse="") == [("string_too_short", ("block_reuse",))]
    assert _rejects(EngineSection, block_reuse=False) == [("string_type", ("block_reuse",))]


def test_engine_nullable_fields() -> None:
    eng = EngineSection(preferred_transceiver_runtime=None, max_seq_len=None)
    assert eng.max_seq_len is None
    assert EngineSection(preferred_transceiver_runtime="PYTHON").preferred_transceiver_runtime


# ------------------------------------------------------------- DaemonSection


def test_daemon_defaults() -> None:
    d = DaemonSection()
    assert d.name == "kvxferd"
    assert d.api_socket is None and d.api_socket_path() == "/tmp/kvxferd-kvxferd.sock"
    assert d.peer_listen == "127.0.0.1:47400" and d.peer_listen_hostport() == ("127.0.0.1", 47400)
    assert d.peers == {}
    assert d.http == "127.0.0.1:9400" and d.http_hostport() == ("127.0.0.1", 9400)
    assert (d.drain_timeout_ms, d.heartbeat_interval_ms) == (30000, 1000)
    assert (d.heartbeat_timeout_ms, d.handshake_timeout_ms) == (5000, 5000)
    assert d.shared_secret_file is None and d.read_shared_secret() is None
    assert d.log_level == "INFO"


def test_api_socket_path_uses_name_or_setting() -> None:
    assert DaemonSection(name="ctx0").api_socket_path() == "/tmp/kvxferd-ctx0.sock"
    assert DaemonSection(api_socket="/run/k.sock").api_socket_path() == "/run/k.sock"


@pytest.mark.parametrize("name", ["a b", "ctx/0", "", "é"])
def test_daemon_name_pattern(name: str) -> None:
    assert _rejects(DaemonSection, name=name) == [("string_pattern_mismatch", ("name",))]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("localhost:65535", ("localhost", 65535)),
        ("[::1]:47400", ("::1", 47400)),
        ("node-3.cluster.local:80", ("node-3.cluster.local", 80)),
    ],
)
def test_peer_listen_valid(value: str, expected: tuple[str, int]) -> None:
    assert DaemonSection(peer_listen=value).peer_listen_hostport() == expected


@pytest.mark.parametrize(
    "value",
    ["127.0.0.1", "127.0.0.1:65536", ":47400", "::1:80", "h:-1", "h:port", "[zz]:1", "a b:1"],
)
def test_peer_listen_invalid(value: str) -> None:
    assert _rejects(DaemonSection, peer_listen=value) == [("value_error", ("peer_listen",))]


def test_peers_validated_per_entry() -> None:
    d = DaemonSection(peers={"gen0": "10.0.0.2:47401", "gen-1": "[fe80::1]:1"})
    assert d.peer_hostports() == {"gen0": ("10.0.0.2", 47401), "gen-1": ("fe80::1", 1)}
    errors = _rejects(DaemonSection, peers={"ok": "h:0", "bad name": "h:1"})
    assert ("value_error", ("peers", "ok")) in errors  # port 0 cannot be dialled
    assert ("string_pattern_mismatch", ("peers", "bad name", "[key]")) in errors


def test_http_nullable_and_validated() -> None:
    assert DaemonSection(http=None).http_hostport() is None
    assert _rejects(DaemonSection, http="9400") == [("value_error", ("http",))]


@pytest.mark.parametrize(
    "name",
    ["drain_timeout_ms", "heartbeat_interval_ms", "heartbeat_timeout_ms", "handshake_timeout_ms"],
)
def test_daemon_timers_gt_zero(name: str) -> None:
    assert ("greater_than", (name,)) in _rejects(DaemonSection, **{name: 0})


def test_heartbeat_timeout_must_exceed_interval() -> None:
    assert _rejects(DaemonSection, heartbeat_interval_ms=2000, heartbeat_timeout_ms=2000) == [
        ("value_error", ("heartbeat_timeout_ms",))
    ]
    assert DaemonSection(heartbeat_interval_ms=2000, heartbeat_timeout_ms=2001)


def test_log_level_literal() -> None:
    assert _rejects(DaemonSection, log_level="info") == [("literal_error", ("log_level",))]


def test_read_shared_secret_strips_trailing_whitespace(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"  s3cret value \n\n")
    assert DaemonSection(shared_secret_file=str(secret)).read_shared_secret() == b"  s3cret value"


def test_read_shared_secret_missing_or_empty(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    for path, words in ((tmp_path / "nope", "cannot read"), (empty, "is empty")):
        with pytest.raises(ConfigError) as info:
            DaemonSection(shared_secret_file=str(path)).read_shared_secret()
        assert str(path) in info.value.problems[0] and words in info.value.problems[0]


# ------------------------------------------------------------- KvxferdConfig


def test_whole_config_defaults_and_source() -> None:
    cfg = KvxferdConfig()
    assert cfg.cache_transceiver_config == CacheTransceiverConfig()
    assert cfg.engine == EngineSection() and cfg.daemon == DaemonSection()
    assert cfg.source == "<defaults>"
    assert cfg.with_source("x.yaml").source == "x.yaml"
    assert "source" not in KvxferdConfig.model_fields  # not a YAML key
    assert _rejects(KvxferdConfig, source="x") == [("extra_forbidden", ("source",))]

"""Property: any valid CacheTransceiverConfig survives a trip through YAML unchanged."""

from __future__ import annotations

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.config import CacheTransceiverConfig, load_config_text

positive_or_null = st.none() | st.integers(min_value=1, max_value=2**63)

configs = st.builds(
    CacheTransceiverConfig,
    backend=st.sampled_from([None, "DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI"]),
    transceiver_runtime=st.sampled_from([None, "CPP", "PYTHON", "auto"]),
    max_tokens_in_buffer=st.none() | st.integers(min_value=-(2**63), max_value=2**63),
    kv_transfer_timeout_ms=positive_or_null,
    kv_transfer_sender_future_timeout_ms=positive_or_null,
    kv_transfer_poll_interval_ms=positive_or_null,
    kv_cache_bounce_size_mb=st.integers(min_value=0, max_value=2**40),
    enable_pipelined_transfer=st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(cfg=configs, flow=st.booleans())
def test_yaml_round_trip(cfg: CacheTransceiverConfig, flow: bool) -> None:
    text = yaml.safe_dump({"cache_transceiver_config": cfg.advertised()}, default_flow_style=flow)
    loaded = load_config_text(text, "roundtrip.yaml")
    assert loaded.cache_transceiver_config == cfg


@settings(max_examples=100, deadline=None)
@given(cfg=configs)
def test_advertised_round_trip(cfg: CacheTransceiverConfig) -> None:
    assert CacheTransceiverConfig.from_advertised(cfg.advertised()) == cfg
    assert cfg.differences(CacheTransceiverConfig.from_advertised(cfg.advertised())) == []


@settings(max_examples=100, deadline=None)
@given(ours=configs, peer=configs)
def test_differences_empty_exactly_when_equal(
    ours: CacheTransceiverConfig, peer: CacheTransceiverConfig
) -> None:
    lines = ours.differences(peer)
    assert (lines == []) == (ours == peer)
    changed = {
        name
        for name in CacheTransceiverConfig.model_fields
        if getattr(ours, name) != getattr(peer, name)
    }
    assert {line.split(":")[0] for line in lines} == changed

"""kvxferd's configuration: the seed's CacheTransceiverConfig, the engine and daemon
sections, YAML loading (kvxferd and TensorRT-LLM disaggregated files) and resolution
of the effective settings. See docs/configuration.md."""

from kvxferd.config.loader import load_config, load_config_text, load_disagg_pair
from kvxferd.config.model import CacheTransceiverConfig, KvxferdConfig
from kvxferd.config.resolve import ResolvedSettings, resolve
from kvxferd.config.sections import DaemonSection, EngineSection, KvLayoutSpec

__all__ = [
    "CacheTransceiverConfig",
    "DaemonSection",
    "EngineSection",
    "KvLayoutSpec",
    "KvxferdConfig",
    "ResolvedSettings",
    "load_config",
    "load_config_text",
    "load_disagg_pair",
    "resolve",
]

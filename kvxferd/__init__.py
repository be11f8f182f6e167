"""kvxferd: moves LLM KV-cache blocks between context and generation servers."""

__version__ = "0.1.0"

# Bumped whenever a peer or engine message changes incompatibly.
PROTOCOL_VERSION = 1

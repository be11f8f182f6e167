"""Shared by the configuration tests (imported as a top-level module, like
tests/daemon/daemon_harness.py: tests/config has no __init__.py)."""

from __future__ import annotations

# The keys every resolved-settings JSON document carries (`kvxferd config explain
# --json`, ResolvedSettings.to_json).
JSON_KEYS = frozenset(
    {
        "backend",
        "runtime",
        "runtime_reason",
        "bounce_buffer_mb",
        "pipelined_transfer",
        "admission_window_blocks",
        "kv_transfer_timeout_ms",
        "kv_transfer_sender_future_timeout_ms",
        "kv_transfer_poll_interval_ms",
        "max_tokens_in_buffer",
    }
)

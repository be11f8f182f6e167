"""MOONCAKE's own timeouts, set from kv_transfer_timeout_ms before its engine starts
(kvxferd/backends/mooncake.py calls apply_timeouts).

kvxferd's kv_transfer_timeout_ms bounds a request; Mooncake's TCP transport
has two timeouts of its own that bound one write: MC_TCP_PROGRESS_TIMEOUT_SEC
(no payload progress for that long) and MC_TCP_STATUS_TIMEOUT_SEC (no
acknowledgement that long after the last byte). Both default to 30 s. They
are set, before the engine starts, to half of kv_transfer_timeout_ms in whole
seconds (at least 1, Mooncake's granularity; at most its default of 30), so a
write to a stopped peer fails, and its handle can be released, within half
our deadline. With kv_transfer_timeout_ms null, Mooncake keeps its defaults.
MC_TRANSFER_TIMEOUT, which bounds only Mooncake's blocking calls (not used
here), is set to the same value but at least 5, Mooncake's minimum for it.
A value the operator already set in the environment wins, with a warning
when it is not below kv_transfer_timeout_ms. These variables are read by the
whole process; a daemon has one engine.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("kvxferd.backends.mooncake")

# Mooncake's TCP timeouts (seconds): its default, and the variables that set them.
MOONCAKE_DEFAULT_TIMEOUT_S = 30
_TCP_TIMEOUT_VARS = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
_SYNC_TIMEOUT_VAR = "MC_TRANSFER_TIMEOUT"
_SYNC_TIMEOUT_MIN_S = 5  # Mooncake clamps MC_TRANSFER_TIMEOUT to at least this


def mooncake_timeout_s(transfer_timeout_ms: int | None) -> int | None:
    """Mooncake's per-write TCP timeout for our kv_transfer_timeout_ms: half of it in
    whole seconds, between 1 and Mooncake's default. None: keep Mooncake's default."""
    if transfer_timeout_ms is None:
        return None
    return max(1, min(MOONCAKE_DEFAULT_TIMEOUT_S, transfer_timeout_ms // 2000))


def apply_timeouts(transfer_timeout_ms: int | None) -> int:
    """Set Mooncake's timeouts in the environment (before its engine starts) and
    return the per-write timeout in effect, in seconds."""
    chosen = mooncake_timeout_s(transfer_timeout_ms)
    effective = MOONCAKE_DEFAULT_TIMEOUT_S if chosen is None else chosen
    for var in _TCP_TIMEOUT_VARS:
        mine = os.environ.get(var)
        if mine is None:
            if chosen is not None:
                os.environ[var] = str(chosen)
            continue
        # The operator's value wins; Mooncake ignores what is not a positive integer.
        value = int(mine) if mine.strip().isdigit() and int(mine) > 0 else None
        seconds = MOONCAKE_DEFAULT_TIMEOUT_S if value is None else value
        effective = max(effective, seconds)
        if transfer_timeout_ms is not None and seconds * 1000 >= transfer_timeout_ms:
            log.warning(
                "%s=%s is not below kv_transfer_timeout_ms (%d ms): a write to a stopped peer "
                "then outlives the request's deadline, and its staging stays in use until "
                "Mooncake gives up",
                var,
                mine,
                transfer_timeout_ms,
            )
    if chosen is not None and _SYNC_TIMEOUT_VAR not in os.environ:
        os.environ[_SYNC_TIMEOUT_VAR] = str(max(_SYNC_TIMEOUT_MIN_S, chosen))
    return effective

"""Resolved settings in words, for `kvxferd config explain`."""

from __future__ import annotations

from kvxferd.config.model import KvxferdConfig
from kvxferd.config.resolve import ResolvedSettings, memory_text

# What each timer bounds, in the seed's words; the second text is what null means.
TIMEOUT_ROLES: dict[str, tuple[str, str]] = {
    "kv_transfer_timeout_ms": (
        "the KV transfer deadline. The sender uses it as one absolute deadline from the first "
        "send of a request, never reset; the receiver applies it to each receive task. "
        "Distinct from the sender's wait slice.",
        "null: no transfer deadline (allowed only with the CPP runtime).",
    ),
    "kv_transfer_sender_future_timeout_ms": (
        "the length of each bounded wait slice while the sender polls for completion; "
        "between slices it checks cancellation, peer health and the deadline. It does not "
        "set the overall transfer deadline.",
        "null: the sender waits for completion without slicing, up to the transfer deadline.",
    ),
    "kv_transfer_poll_interval_ms": (
        "how often requests waiting for admission are re-evaluated while in-flight transfers "
        "fill the admission window.",
        "null: waiting requests are re-evaluated only when an in-flight transfer finishes.",
    ),
}


def timeout_role(name: str, value: int | None) -> str:
    """What the timer `name` bounds, given its value."""
    role, when_null = TIMEOUT_ROLES[name]
    return when_null if value is None else role[0].upper() + role[1:]


def admission_text(cfg: KvxferdConfig, settings: ResolvedSettings) -> str:
    if settings.admission_window_blocks is None:
        return "none: max_tokens_in_buffer is not set, so admission is not limited by blocks"
    per_block = cfg.engine.kv_layout.tokens_per_block
    poll = settings.kv_transfer_poll_interval_ms
    again = f"every {poll} ms" if poll is not None else "when a transfer finishes"
    return (
        f"{settings.admission_window_blocks} blocks (max_tokens_in_buffer "
        f"{settings.max_tokens_in_buffer} / tokens_per_block {per_block}); requests beyond it "
        f"wait in arrival order and are re-evaluated {again}"
    )


def discovery_text(cfg: KvxferdConfig) -> str:
    """How peer names resolve (docs/operations.md, "Discovery with etcd")."""
    d = cfg.daemon
    if d.discovery == "static" or d.etcd is None:
        return f"static: {len(d.peers)} peer(s) in daemon.peers; other receives name HOST:PORT"
    e = d.etcd
    tls = "TLS" if e.ca_file else "plaintext"
    return (
        f"etcd at {', '.join(e.endpoints)} ({tls}), registered as {e.prefix}{d.name} "
        f"under a {e.lease_ttl_s} s lease"
    )


def explain_lines(cfg: KvxferdConfig, settings: ResolvedSettings) -> list[str]:
    """A human explanation of `settings`, one line per list item."""
    lines = [
        f"{cfg.source}: daemon {cfg.daemon.name!r}, engine role {cfg.engine.role}",
        f"backend:            {settings.backend} ({settings.backend_reason})",
        f"runtime:            {settings.runtime} ({settings.runtime_reason})",
        "timeouts:",
    ]
    for name in TIMEOUT_ROLES:
        value = getattr(settings, name)
        shown = "null" if value is None else f"{value} ms"
        lines.append(f"  {name} = {shown}")
        lines.append(f"      {timeout_role(name, value)}")
    lines += [
        f"bounce buffer:      {settings.bounce_reason}",
        f"pipelined transfer: {settings.pipelined_reason}",
        f"admission window:   {admission_text(cfg, settings)}",
        f"KV memory:          {memory_text(settings)}",
        f"discovery:          {discovery_text(cfg)}",
        f"peer fingerprint:   {settings.fingerprint()} "
        f"(backend, runtime and pipelining must match the peer's"
        + (", and so must kv_memory vram)" if settings.kv_memory == "vram" else ")"),
    ]
    lines += [f"note: {n}" for n in settings.notes if settings.runtime_reason not in n]
    return lines

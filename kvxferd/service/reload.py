"""SIGHUP: re-read the configuration file, validate it fully, apply what can change live.

The file is read again exactly as at start-up (same path, same --role and other
command-line overrides), loaded, resolved, its shared secret read, and checked
against what this build can start. Any problem rejects the whole reload: the
running configuration stays as it was and the problems are logged (a failed
reload changes nothing).

Applied live (new requests use the new values; a request already in flight
keeps the deadline it was given when it was accepted):

* cache_transceiver_config.kv_transfer_timeout_ms, kv_transfer_sender_future_timeout_ms,
  kv_transfer_poll_interval_ms, max_tokens_in_buffer (the admission window);
* daemon.log_level, drain_timeout_ms, heartbeat_interval_ms, heartbeat_timeout_ms,
  handshake_timeout_ms (for connections made from now on), stall_unhealthy_s, and the
  static peers;
* the mutual-TLS certificate, key and CA (daemon.tls_*): read again on every reload, so a
  rotated certificate under the same path is picked up; peer connections made from then on
  use it, established ones keep theirs. Files that do not load reject the reload.

Everything else (backend, runtime, pipelining, bounce buffer, the engine
section and KV layout, name, addresses, the shared secret, turning TLS on or off...) needs
a restart:
each such difference is reported in a WARNING and in the systemd STATUS line,
and the running value is kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvxferd.backends import registry
from kvxferd.config import KvxferdConfig, ResolvedSettings, resolve
from kvxferd.errors import ConfigError, KvxferdError
from kvxferd.peers import tls
from kvxferd.peers.tls import PeerTls
from kvxferd.service.logs import set_level
from kvxferd.service.timeouts import timeouts_of

if TYPE_CHECKING:
    from kvxferd.service.view import DaemonView

log = logging.getLogger("kvxferd.reload")

ConfigLoader = Callable[[], KvxferdConfig]

_CTC = "cache_transceiver_config"
# Fields applied to the running daemon, by section.
LIVE_TRANSCEIVER = (
    "kv_transfer_timeout_ms",
    "kv_transfer_sender_future_timeout_ms",
    "kv_transfer_poll_interval_ms",
    "max_tokens_in_buffer",
)
LIVE_DAEMON = (
    "log_level",
    "drain_timeout_ms",
    "heartbeat_interval_ms",
    "heartbeat_timeout_ms",
    "handshake_timeout_ms",
    "peers",
    "stall_unhealthy_s",  # read from daemon.cfg at each health check
    "max_requests",  # read from daemon.cfg at each recv, send and peer request
    *tls.FIELDS,
)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class ReloadReport:
    result: str  # "applied" (something changed live), "unchanged" or "rejected"
    applied: list[str] = field(default_factory=list)
    restart_needed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    at: float = field(default_factory=time.time)

    def to_json_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def status_line(self) -> str:
        if self.result == "rejected":
            return f"reload rejected, running configuration kept: {self.problems[0]}"
        line = f"reload {self.result}"
        if self.applied:
            line += f" ({len(self.applied)} change(s) applied)"
        if self.restart_needed:
            line += "; restart needed for: " + ", ".join(
                item.split(":", 1)[0] for item in self.restart_needed
            )
        return line


def _flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and path != "daemon.peers":
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def startup_problems(cfg: KvxferdConfig, settings: ResolvedSettings) -> list[str]:
    """What would stop `kvxferd run` with this configuration (the daemon's own checks)."""
    problems = []
    problem = registry.startup_problem(settings.backend, settings.runtime)
    if problem is not None:
        problems.append(problem)
    host = cfg.daemon.peer_listen_hostport()[0]
    if not cfg.daemon.peers_authenticated and host not in _LOOPBACK:
        problems.append(
            f"daemon.peer_listen {cfg.daemon.peer_listen} is not loopback, so peers must "
            "authenticate: set daemon.shared_secret_file or the daemon.tls_* files"
        )
    return problems


@dataclass
class Candidate:
    """A configuration read again, with the files it names loaded."""

    cfg: KvxferdConfig
    settings: ResolvedSettings
    secret: bytes | None
    tls: PeerTls | None


def validate(load: ConfigLoader) -> Candidate:
    """Load, resolve and check a configuration as a start-up would; ConfigError lists problems."""
    cfg = load()
    settings = resolve(cfg)
    secret = cfg.daemon.read_shared_secret()
    peer_tls = tls.load(cfg.daemon)  # read again even with the same paths: rotation
    problems = startup_problems(cfg, settings)
    if problems:
        raise ConfigError(problems[0], problems)
    return Candidate(cfg, settings, secret, peer_tls)


def plan(
    old: KvxferdConfig,
    old_settings: ResolvedSettings,
    old_secret: bytes | None,
    new: KvxferdConfig,
    new_settings: ResolvedSettings,
    new_secret: bytes | None,
) -> tuple[KvxferdConfig, ResolvedSettings, ReloadReport]:
    """The configuration to run with after the reload, and what changed."""
    before = _flatten(old.model_dump(mode="json"))
    after = _flatten(new.model_dump(mode="json"))
    live = {f"{_CTC}.{k}" for k in LIVE_TRANSCEIVER} | {f"daemon.{k}" for k in LIVE_DAEMON}
    report = ReloadReport(result="unchanged")
    ctc_updates: dict[str, object] = {}
    daemon_updates: dict[str, object] = {}
    for path in sorted(set(before) | set(after)):
        was, now = before.get(path), after.get(path)
        if was == now:
            continue
        change = f"{new.yaml_path(path)}: {was!r} -> {now!r}"
        if path not in live:
            report.restart_needed.append(change)
            continue
        section, key = path.split(".", 1)
        if key in tls.FIELDS and (was is None) != (now is None):
            # Turning TLS on or off changes what every peer must speak: a restart.
            report.restart_needed.append(change)
            continue
        if key == "kv_transfer_timeout_ms" and now is None:
            # Only a restart can leave the PYTHON runtime (which needs a finite timeout).
            report.restart_needed.append(change)
            continue
        if key == "max_tokens_in_buffer" and (
            old.engine.kv_layout.tokens_per_block != new.engine.kv_layout.tokens_per_block
        ):
            report.restart_needed.append(change + " (tokens_per_block changes too)")
            continue
        (ctc_updates if section == _CTC else daemon_updates)[key] = getattr(
            getattr(new, section), key
        )
        report.applied.append(change)
    for name in ("backend", "runtime", "pipelined_transfer", "bounce_buffer_mb"):
        was, now = getattr(old_settings, name), getattr(new_settings, name)
        if was != now:
            report.restart_needed.append(f"{name} (resolved): {was!r} -> {now!r}")
    if old_secret != new_secret and not any(
        item.startswith("daemon.shared_secret_file") for item in report.restart_needed
    ):
        report.restart_needed.append("daemon.shared_secret_file: the secret's contents changed")
    merged = old.model_copy(
        update={
            _CTC: old.cache_transceiver_config.model_copy(update=ctc_updates),
            "daemon": old.daemon.model_copy(update=daemon_updates),
        }
    )
    ctc = merged.cache_transceiver_config
    window = old_settings.admission_window_blocks
    if "max_tokens_in_buffer" in ctc_updates:
        window = new_settings.admission_window_blocks
    merged_settings = dataclasses.replace(
        old_settings,
        kv_transfer_timeout_ms=ctc.kv_transfer_timeout_ms,
        kv_transfer_sender_future_timeout_ms=ctc.kv_transfer_sender_future_timeout_ms,
        kv_transfer_poll_interval_ms=ctc.kv_transfer_poll_interval_ms,
        max_tokens_in_buffer=ctc.max_tokens_in_buffer,
        admission_window_blocks=window,
    )
    # "unchanged": nothing about the running daemon changed (a pending restart may still be listed).
    if report.applied:
        report.result = "applied"
    return merged, merged_settings, report


def apply(daemon: DaemonView, cfg: KvxferdConfig, settings: ResolvedSettings) -> None:
    """Make the running daemon use `cfg`'s live values (from here on, for new work)."""
    d = cfg.daemon
    assert settings.kv_transfer_timeout_ms is not None  # plan() never applies null
    # The same conversion as at start-up. Requests already accepted keep the timeout
    # they read then (docs/operations.md); the rest is read live.
    daemon.sender.timeouts, daemon.receiver.timeouts = timeouts_of(cfg, settings)
    poll_ms = settings.kv_transfer_poll_interval_ms
    daemon.admission.resize(settings.admission_window_blocks, poll_ms / 1e3 if poll_ms else None)
    timings = daemon.peers.timings
    timings.handshake_s = d.handshake_timeout_ms / 1e3
    timings.heartbeat_interval_s = d.heartbeat_interval_ms / 1e3
    timings.heartbeat_timeout_s = d.heartbeat_timeout_ms / 1e3
    daemon.peers.static_peers.clear()
    daemon.peers.static_peers.update(d.peers)
    set_level(d.log_level)
    daemon.cfg = cfg
    daemon.settings = settings


def _tls_rotation(running: PeerTls | None, new: PeerTls | None) -> str:
    """What a reload changes in the peer TLS, as a report line ('' when nothing). Only
    new certificates while TLS stays on: turning it on or off is a restart (plan)."""
    if running is None or new is None or running.fingerprint == new.fingerprint:
        return ""
    return (
        f"daemon.tls_*: certificates reloaded ({running.fingerprint} -> {new.fingerprint}, "
        f"expires {new.not_after or '?'}) for new peer connections"
    )


async def reload_once(daemon: DaemonView, load: ConfigLoader) -> ReloadReport:
    """One SIGHUP: RELOADING=1, validate, apply or reject, READY=1."""
    daemon.notifier.reloading()
    source = daemon.cfg.source
    log.info("SIGHUP: reloading %s", source)
    try:
        candidate = await asyncio.to_thread(validate, load)
    except ConfigError as exc:
        report = ReloadReport(result="rejected", problems=list(exc.problems))
    except KvxferdError as exc:
        report = ReloadReport(result="rejected", problems=[str(exc)])
    else:
        log.debug("reload: %s loaded, resolved and checked", source)
        merged, merged_settings, report = plan(
            daemon.cfg,
            daemon.settings,
            daemon.identity.secret if daemon.secret_configured else None,
            candidate.cfg,
            candidate.settings,
            candidate.secret,
        )
        rotated = _tls_rotation(daemon.peers.tls, candidate.tls)
        if rotated:
            report.applied.append(rotated)
            report.result = "applied"
        if daemon.draining:
            report = ReloadReport(result="rejected", problems=["the daemon is draining"])
        elif report.applied:
            apply(daemon, merged, merged_settings)
            if rotated:
                daemon.peers.tls = candidate.tls
    if report.result == "rejected":
        log.error("reload of %s rejected; the running configuration is kept:", source)
        for problem in report.problems:
            log.error("  %s", problem)
    else:
        for change in report.applied:
            log.info("reload: applied %s", change)
        for change in report.restart_needed:
            log.warning("reload: %s needs a restart; keeping the running value", change)
        log.info("reload of %s: %s", source, report.status_line())
    daemon.last_reload = report
    daemon.metrics.reloads.labels(result=report.result).inc()
    daemon.notifier.ready(report.status_line())
    return report


async def serve_reloads(daemon: DaemonView, requests: asyncio.Event, load: ConfigLoader) -> None:
    """Run one reload per burst of SIGHUPs, one at a time, while the daemon serves."""
    while True:
        await requests.wait()
        requests.clear()
        if daemon.draining:
            log.warning("SIGHUP ignored: the daemon is draining")
            continue
        try:
            await reload_once(daemon, load)
        except Exception:  # a bug in a reload must not take the daemon down
            log.exception("reload failed unexpectedly; the running configuration is kept")
            daemon.notifier.ready("reload failed unexpectedly; running configuration kept")

"""`kvxferd run --config FILE`: start a daemon and serve until SIGTERM or SIGINT
(SIGHUP reloads the file with the same command-line overrides)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from kvxferd.errors import ConfigError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="run a daemon for one engine")
    p.add_argument("--config", required=True, metavar="FILE", help="kvxferd or TensorRT-LLM YAML")
    p.add_argument("--role", choices=["context", "generation", "both"], help="override engine.role")
    p.add_argument("--api-socket", metavar="PATH", help="override daemon.api_socket")
    p.add_argument("--peer-listen", metavar="HOST:PORT", help="override daemon.peer_listen")
    p.add_argument("--http", metavar="HOST:PORT", help="override daemon.http ('off' disables)")
    p.add_argument("--name", help="override daemon.name")
    p.add_argument(
        "--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="override log level"
    )
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text: readable lines (default); json: one JSON object per line",
    )
    p.set_defaults(handler=_run)


def load_with_overrides(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from kvxferd.config import load_config

    cfg = load_config(args.config, role=args.role)
    daemon_updates: dict[str, object] = {}
    for flag, key in (
        ("api_socket", "api_socket"),
        ("peer_listen", "peer_listen"),
        ("name", "name"),
        ("log_level", "log_level"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            daemon_updates[key] = value
    if args.http is not None:
        daemon_updates["http"] = None if args.http == "off" else args.http
    if daemon_updates:
        merged = cfg.daemon.model_dump() | daemon_updates
        try:
            daemon = type(cfg.daemon).model_validate(merged)
        except ValidationError as exc:
            problems = [
                f"command line: --{'.'.join(str(x) for x in e['loc']).replace('_', '-')}: "
                f"{e['msg']} (got {e.get('input')!r})"
                for e in exc.errors()
            ]
            raise ConfigError(problems[0], problems) from exc
        cfg = cfg.model_copy(update={"daemon": daemon})
    return cfg


def _run(args: argparse.Namespace) -> int:
    from kvxferd.config import resolve
    from kvxferd.service.copy_tuning import log_nt_copies
    from kvxferd.service.cpu_policy import log_cpu_policy
    from kvxferd.service.daemon import Daemon
    from kvxferd.service.heap_tuning import log_keep_freed_heap
    from kvxferd.service.runner import (
        install_reload_signal,
        install_shutdown_signals,
        run_event_loop,
        setup_logging,
    )

    cfg = load_with_overrides(args)
    setup_logging(cfg.daemon.log_level, args.log_format)
    log_nt_copies()
    log_keep_freed_heap()
    settings = resolve(cfg)
    # Before the daemon starts its threads (the data plane's, the transport's): each then
    # inherits the policy from the thread that starts it.
    log_cpu_policy(cfg.daemon.cpu_policy, settings.backend)

    async def main() -> int:
        stop = asyncio.Event()
        reload = asyncio.Event()
        install_shutdown_signals(stop)
        install_reload_signal(reload)
        daemon = Daemon(cfg, settings)
        await daemon.serve(stop, reload, lambda: load_with_overrides(args))
        return 0

    return run_event_loop(main)

"""`kvxferd config validate|explain FILE [--role R]`: check and explain a configuration.

Both load the file and resolve it exactly as the daemon does at start-up, so a
file that validates here does not fail there for configuration reasons. Problems
are raised as ConfigError; kvxferd.cli prints one line per problem and exits 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvxferd.config import KvxferdConfig, ResolvedSettings, load_config, resolve
from kvxferd.config.explain import explain_lines
from kvxferd.config.loader import is_disagg_text, load_disagg_roles
from kvxferd.errors import ConfigError

ROLE_CHOICES = ("context", "generation", "both")


def add_parser(subparsers: Any) -> None:
    """Register `config` and its actions on the top-level subparsers."""
    parser = subparsers.add_parser(
        "config",
        help="check or explain a configuration file",
        description="Check or explain a kvxferd (or TensorRT-LLM disaggregated) "
        "configuration file.",
    )
    actions = parser.add_subparsers(dest="config_action", metavar="ACTION")

    def usage(_: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    parser.set_defaults(handler=usage)

    validate = actions.add_parser(
        "validate",
        help="check a file; exit 0 if valid, 2 with one line per problem if not",
        description="Load and resolve FILE as the daemon would. For a TensorRT-LLM "
        "disaggregated file without --role, check both sections and that they agree on "
        "backend, runtime and pipelining.",
    )
    validate.add_argument("file", metavar="FILE")
    validate.add_argument("--role", choices=ROLE_CHOICES, help="the role to read the file for")
    validate.set_defaults(handler=run_validate)

    explain = actions.add_parser(
        "explain",
        help="show the resolved settings and why",
        description="Show the effective backend, runtime, timeouts, bounce buffer, "
        "pipelining and admission window of FILE, each with its reason.",
    )
    explain.add_argument("file", metavar="FILE")
    explain.add_argument("--role", choices=ROLE_CHOICES, help="the role to read the file for")
    explain.add_argument("--json", action="store_true", help="print one JSON object")
    explain.set_defaults(handler=run_explain)


@contextmanager
def _warnings_to_stderr() -> Iterator[None]:
    """Show resolution warnings (runtime fallback, unused settings) on stderr."""
    log = logging.getLogger("kvxferd.config")
    if log.handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("kvxferd: warning: %(message)s"))
    handler.setLevel(logging.WARNING)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


def _emit(text: str) -> None:
    """Print to stdout; a reader that went away (`| head`) is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _summary(cfg: KvxferdConfig, settings: ResolvedSettings) -> str:
    window = settings.admission_window_blocks
    return (
        f"role {cfg.engine.role}: {settings.backend} backend, {settings.runtime} runtime, "
        f"pipelined {'on' if settings.pipelined_transfer else 'off'}, bounce "
        f"{f'{settings.bounce_buffer_mb} MiB' if settings.bounce_buffer_mb else 'off'}, "
        f"admission window {f'{window} blocks' if window is not None else 'none'}"
    )


def _is_disagg(path: str) -> bool:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False  # load_config reports it properly
    return is_disagg_text(text, path)


def _validate_pair(path: str) -> str:
    configs = load_disagg_roles(path)
    resolved: dict[str, ResolvedSettings] = {}
    problems: list[str] = []
    for role, cfg in configs.items():
        try:
            resolved[role] = resolve(cfg)
        except ConfigError as exc:
            problems += [f"{p} [{role} role]" for p in exc.problems]
    if len(resolved) == 2:
        ctx, gen = resolved["context"], resolved["generation"]
        for key, ours in ctx.peer_compat_fields().items():
            theirs = gen.peer_compat_fields()[key]
            if ours != theirs:
                why = ""
                if key == "runtime":
                    why = f" (context: {ctx.runtime_reason}; generation: {gen.runtime_reason})"
                problems.append(
                    f"{path}: context_servers and generation_servers disagree on the effective "
                    f"{key}: context {ours}, generation {theirs}{why}; their daemons would "
                    "refuse each other, so make the two cache_transceiver_config sections "
                    "consistent"
                )
    if problems:
        raise ConfigError(f"{path}: invalid configuration", problems)
    parts = [f"{role}: {_summary(configs[role], s)}" for role, s in resolved.items()]
    return f"{path}: valid TensorRT-LLM disaggregated file; " + "; ".join(parts)


def run_validate(args: argparse.Namespace) -> int:
    with _warnings_to_stderr():
        if args.role is None and _is_disagg(args.file):
            _emit(_validate_pair(args.file))
            return 0
        cfg = load_config(args.file, role=args.role)
        settings = resolve(cfg)
    _emit(f"{args.file}: valid; {_summary(cfg, settings)}")
    return 0


def run_explain(args: argparse.Namespace) -> int:
    with _warnings_to_stderr():
        cfg = load_config(args.file, role=args.role)
        settings = resolve(cfg)
    if args.json:
        out = settings.to_json_dict()
        out.update(source=cfg.source, role=cfg.engine.role, daemon=cfg.daemon.name)
        _emit(json.dumps(out, indent=2))
    else:
        _emit("\n".join(explain_lines(cfg, settings)))
    return 0

"""The `kvxferd` command line. Each subcommand lives in kvxferd/commands/ and
registers itself through `add_parser`; this module only dispatches and turns
KvxferdError into a clean message and exit status (never a traceback)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvxferd import __version__
from kvxferd.errors import ConfigError, KvxferdError

# Modules under kvxferd.commands that provide add_parser(subparsers).
# Imported lazily per module so that `kvxferd config ...` never loads a backend.
_COMMAND_MODULES = (
    "config_cmd",
    "run_cmd",
    "demo_cmd",
    "status_cmd",
    "fence_cmd",
    "bench_cmd",
    "certs_cmd",
)

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvxferd",
        description="KV-cache transfer daemon for disaggregated LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"kvxferd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"kvxferd.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"kvxferd.commands.{name}":
                continue  # command not built yet
            raise
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["run"]:
        # A daemon of its own process starts again once with glibc's tunables set
        # (service/copy_tuning.py); first thing, so that the restart costs only the
        # interpreter's start, not the imports of every command. Never a caller's process.
        from kvxferd.service.copy_tuning import reexec_with_nt_copies

        reexec_with_nt_copies()  # returns only when it need not or could not
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(handler(args))
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"kvxferd: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    except KvxferdError as exc:
        print(f"kvxferd: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

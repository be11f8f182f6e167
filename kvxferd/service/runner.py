"""Runs a daemon on uvloop with signal handling.

The first SIGTERM or SIGINT asks for a graceful drain; a second one forces the
exit. After a clean drain the process exits 0. SIGHUP asks for a reload of the
configuration file (kvxferd.service.reload).
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from kvxferd.service.loopmon import stop_watching, watch_for_stalls

log = logging.getLogger("kvxferd.daemon")


def setup_logging(level: str, fmt: str = "text") -> None:
    from kvxferd.service.logs import setup_logging as setup

    setup(level, fmt)


def run_event_loop(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    # A fatal signal (SIGBUS from a shm-name pool its engine shrank, SIGSEGV) then leaves the
    # Python stacks of every thread in the log instead of a bare exit status. A handler the
    # backend installs later (UCX prints its own backtrace) takes precedence.
    faulthandler.enable(all_threads=True)
    # One daemon in this process: its loop monitor may watch for stalls (a thread).
    watch_for_stalls()
    try:
        return _run(main)
    finally:
        stop_watching()


def _run(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; keep working if a platform lacks it
        return asyncio.run(main())
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main())
    uvloop.install()
    return asyncio.run(main())


def install_shutdown_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log.error("second %s: forcing exit", name)
            os._exit(1)
        log.info("%s received: draining", name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


def install_reload_signal(reload: asyncio.Event) -> None:
    """SIGHUP sets `reload`; the daemon reloads once it is ready (bursts coalesce)."""
    # UCX (under NIXL) takes SIGHUP as its debug signal by default and replaces
    # any handler when the data plane starts; 0 leaves SIGHUP to us. Must be set
    # before the backend loads; an operator's own setting wins.
    os.environ.setdefault("UCX_DEBUG_SIGNO", "0")

    def on_hup() -> None:
        log.info("SIGHUP received: reload requested")
        reload.set()

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_hup)

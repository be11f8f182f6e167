"""Timeline tracing for benchmarks/gpu_profile.sh: when KVXFERD_TRACE_DIR is set, every
process that starts with this folder on PYTHONPATH (the bench, its engines, both daemons)
notes when chosen kvxferd functions begin and end, in DIR/<pid>.trace:

    argv ...                 (first line)
    <monotonic ns> B|E <function> <thread name>

time.monotonic_ns is one clock for every process of the machine, so
benchmarks/trace_timeline.py lines the processes up per request. Benchmark tooling only:
nothing in kvxferd imports this, and without the variable it does nothing.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import threading
import time
from typing import Any

_DIR = os.environ.get("KVXFERD_TRACE_DIR", "")

# module -> "Class.method" or "function" names to trace.
TARGETS: dict[str, tuple[str, ...]] = {
    "kvxferd.client": (
        "AsyncClient.send",
        "AsyncClient.recv",
        "AsyncClient.start_send",
        "AsyncClient.start_recv",
    ),
    "kvxferd.peers.framing": ("CorkedWriter.flush",),
    "kvxferd.bench.engine": ("StampingClient._on_outcome",),
    "kvxferd.service.engine_calls": ("EngineCalls._send", "EngineCalls._recv"),
    "kvxferd.api.server": ("EngineConnection.deliver",),
    "kvxferd.transceiver.bounce": (
        "BounceBuffers.gather",
        "BounceBuffers.scatter",
        "ArrayCopier._copy",
    ),
    "kvxferd.transceiver.writes": ("Writes.post_and_wait", "Writes._post_if_wanted"),
    "kvxferd.backends.nixl": ("NixlBackend.post_write", "NixlBackend.poll"),
    "kvxferd.transceiver.direct": ("DirectMover.write_slice", "DirectMover._leg_plan"),
    "kvxferd.transceiver.direct_rx": ("scatter_round",),
    "kvxferd.transceiver.receiver": (
        "Receiver.recv",
        "Receiver.on_result",
        "Receiver._leg_delivered",
        "Receiver._finish",
    ),
    "kvxferd.transceiver.sender": ("Sender.send", "Sender.on_request_data", "Sender._finish"),
    "kvxferd.transceiver.staged_round": ("RoundCrossing.cross",),
    "kvxferd.transceiver.staged_rx": ("StagedReceive.take_round",),
}

_events: list[str] = []
_lock = threading.Lock()


def _note(kind: str, name: str) -> None:
    line = f"{time.monotonic_ns()} {kind} {name} {threading.current_thread().name}\n"
    with _lock:
        _events.append(line)
        if len(_events) >= 2000:
            _flush_locked()


def _flush_locked() -> None:
    if _events:
        with open(os.path.join(_DIR, f"{os.getpid()}.trace"), "a") as f:
            f.writelines(_events)
        _events.clear()


def _flush() -> None:
    with _lock:
        _flush_locked()


def _wrap(fn: Any, name: str) -> Any:
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            _note("B", name)
            try:
                return await fn(*args, **kwargs)
            finally:
                _note("E", name)

        return traced_async

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        _note("B", name)
        try:
            return fn(*args, **kwargs)
        finally:
            _note("E", name)

    return traced


def _patch(module: Any) -> None:
    for target in TARGETS.get(module.__name__, ()):
        owner_name, _, attr = target.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        setattr(owner, attr, _wrap(getattr(owner, attr), target))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    with open(os.path.join(_DIR, f"{os.getpid()}.trace"), "a") as f:
        f.write("argv " + " ".join(sys.argv or ["?"]) + " " + " ".join(sys.orig_argv) + "\n")
    sys.meta_path.insert(0, _Finder())
    atexit.register(_flush)

"""The GPU check's probe protocol and figures: what every probe, the driver and the tests share.

A probe prints its result as `@@gpucheck {json}` lines (emit); a helper process takes JSON
commands a line on stdin and answers the same way (Child on the asking side, commands and serve
on the answering one). Buffers are filled and checked with a pattern (fill, holds: numpy or cupy
alike) and timings become GB/s and percentiles (rate). Apart from the probes
(kvxferd.bench.gpu_probes) because none of this touches a device: the driver
(kvxferd.bench.gpucheck) and the CPU tests use it on any host.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from typing import IO, Any

import numpy as np

#: Prefix of a result line on a probe's stdout.
RESULT = "@@gpucheck "
#: Odd, so word index -> pattern word is a bijection mod 2**64: every word of a buffer differs.
_MULT = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def emit(result: dict[str, Any], out: IO[str] | None = None) -> None:
    stream = out or sys.stdout
    stream.write(RESULT + json.dumps(result, default=str) + "\n")
    stream.flush()


def error_text(exc: BaseException, limit: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- content ---------------------------------------------------------------------------------


def pattern(xp: Any, nwords: int, seed: int) -> Any:
    """The expected uint64 words of a buffer filled with `seed` (numpy or cupy alike)."""
    words = xp.arange(nwords, dtype=xp.uint64)
    words *= xp.uint64(_MULT)
    words ^= xp.uint64((seed * 0xD1B54A32D192ED03 + 1) & _MASK)
    return words


def fill(xp: Any, buf: Any, seed: int, nbytes: int | None = None) -> None:
    n = buf.size if nbytes is None else nbytes
    buf[:n].view(xp.uint64)[...] = pattern(xp, n // 8, seed)


def holds(xp: Any, buf: Any, seed: int, nbytes: int | None = None) -> bool:
    """Whether the first `nbytes` of a uint8 buffer hold `seed`'s pattern (compared where the
    buffer lives: on the device for cupy)."""
    n = buf.size if nbytes is None else nbytes
    return bool(xp.array_equal(buf[:n].view(xp.uint64), pattern(xp, n // 8, seed)))


# -- figures ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (the same convention as kvxferd.bench.stats)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(np.ceil(q / 100.0 * len(ordered)))))
    return float(ordered[rank - 1])


def rate(nbytes: int, times_ms: Sequence[float]) -> dict[str, Any]:
    """GB/s (1e9 bytes/s) of the median run, with the runs' latencies; bytes count once
    (a copy of N bytes is N, not the 2N of read + write)."""
    if not times_ms:
        return {"gbps": None, "best_gbps": None, "p50_ms": None, "p99_ms": None, "runs": 0}
    p50 = percentile(times_ms, 50)
    best = min(times_ms)
    return {
        "gbps": _sig(nbytes / (p50 * 1e6)) if p50 > 0 else None,
        "best_gbps": _sig(nbytes / (best * 1e6)) if best > 0 else None,
        "p50_ms": _sig(p50),
        "p99_ms": _sig(percentile(times_ms, 99)),
        "runs": len(times_ms),
    }


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


# -- child processes with a line protocol ----------------------------------------------------


class ProbeError(RuntimeError):
    """A helper process broke the protocol, failed, or did not answer in time."""


class Child:
    """A helper process: JSON commands on its stdin, `@@gpucheck` answers on its stdout.

    Lines that are not answers (UCX and NIXL write to stdout too) are passed to our stderr,
    so they land in the probe's log instead of confusing the protocol."""

    def __init__(self, name: str, argv: list[str], *, pass_fds: Sequence[int] = ()) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            pass_fds=tuple(pass_fds),
        )
        self._buf = ""

    @classmethod
    def probe(cls, name: str, role: str, *args: str, pass_fds: Sequence[int] = ()) -> Child:
        argv = [sys.executable, "-m", "kvxferd.bench.gpu_probes", role, *args]
        return cls(name, argv, pass_fds=pass_fds)

    def _lines(self, deadline: float) -> Iterator[str]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            while "\n" in self._buf:
                line, self._buf = self._buf.split("\n", 1)
                yield line
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProbeError(f"{self.name}: no answer in time")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.poll()
                raise ProbeError(f"{self.name}: exited (status {code}) before answering")
            self._buf += chunk.decode(errors="replace")

    def answer(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        for line in self._lines(deadline):
            if line.startswith(RESULT):
                out: dict[str, Any] = json.loads(line[len(RESULT) :])
                if out.get("error"):
                    raise ProbeError(f"{self.name}: {out['error']}")
                return out
            sys.stderr.write(f"[{self.name}] {line}\n")
        raise ProbeError(f"{self.name}: no answer")  # pragma: no cover (the loop raises)

    def ask(self, command: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as exc:
            raise ProbeError(f"{self.name}: gone ({exc})") from exc
        return self.answer(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            with suppress(OSError, ValueError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with suppress(OSError, ValueError):
            assert self.proc.stdout is not None
            self.proc.stdout.close()


def commands() -> Iterator[dict[str, Any]]:
    """A helper's commands, one JSON object a line on stdin, until "quit" or end of input."""
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        command: dict[str, Any] = json.loads(line)
        if command.get("cmd") == "quit":
            return
        yield command


def serve(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    for command in commands():
        try:
            emit(handle(command))
        except Exception as exc:
            traceback.print_exc()
            emit({"error": error_text(exc)})

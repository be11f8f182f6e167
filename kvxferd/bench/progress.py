"""A progress bar on stderr (never stdout, which belongs to the table or the JSON).

On a terminal it redraws one line; elsewhere (a log file, a CI job, a test) it prints one
line per finished phase instead of carriage returns.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 28


class Progress:
    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.total = max(1, total)
        self.done = 0
        self.phase = ""
        self._phase_done = 0
        self._phase_total: int | None = 0
        self._phase_deadline: float | None = None
        self._phase_started = time.monotonic()
        self._last_draw = 0.0

    def start_phase(self, label: str, units: int | None, *, seconds: float | None = None) -> None:
        """A new phase of `units` requests (None: open-ended, lasting about `seconds`)."""
        self.phase = label
        self._phase_done = 0
        self._phase_total = units
        self._phase_started = time.monotonic()
        self._phase_deadline = None if seconds is None else self._phase_started + seconds
        self._draw(force=True)

    def advance(self, n: int = 1) -> None:
        if n <= 0:
            return
        self._phase_done += n
        if self._phase_total is not None:
            self.done = min(self.total, self.done + n)
        self._draw()

    def tick(self) -> None:
        """Redraw (time-based phases move without requests finishing)."""
        self._draw()

    def end_phase(self, summary: str = "") -> None:
        if self._phase_total is not None:
            self.done = min(self.total, self.done + max(0, self._phase_total - self._phase_done))
        else:
            self.done = min(self.total, self.done + 1)
        if not self.enabled:
            return
        took = time.monotonic() - self._phase_started
        if self.tty:
            self._draw(force=True)
        else:
            extra = f": {summary}" if summary else ""
            print(
                f"kvxferd bench: {self.phase}: {self._phase_done} requests in {took:.1f} s{extra}",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        frac = self.done / self.total
        if self._phase_total is None and self._phase_deadline is not None:
            span = max(1e-9, self._phase_deadline - self._phase_started)
            frac = min(1.0, (self.done + min(1.0, (now - self._phase_started) / span)) / self.total)
        filled = int(frac * _WIDTH)
        bar = "#" * filled + "." * (_WIDTH - filled)
        count = (
            f"{self._phase_done}/{self._phase_total}"
            if self._phase_total is not None
            else f"{self._phase_done} requests, {now - self._phase_started:4.1f} s"
        )
        self.stream.write(f"\r\x1b[2K[{bar}] {frac * 100:3.0f}%  {self.phase}  {count}")
        self.stream.flush()

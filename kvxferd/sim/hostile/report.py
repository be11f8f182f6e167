"""What a live fuzzing run saw (FuzzReport per part, LiveResult for the whole run), and how
a daemon under fuzz is looked at: its status, its memory, its log (issue 14)."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from kvxferd.sim.cluster import DaemonProc
from kvxferd.sim.hostile.values import FORGED_LINE

# What a daemon log must never hold, whatever it was sent: a Python traceback, or asyncio's
# reports of an exception nobody handled (each comes with a traceback, but not always on
# the same line).
CRASH_MARKERS = (
    "Traceback (most recent call last)",
    "Exception in callback",
    "exception was never retrieved",
    "Unhandled exception",
    "Task was destroyed but it is pending",
)


@dataclass
class FuzzReport:
    """What a live fuzzing run saw. `hung` connections neither answered nor closed within
    the deadline; `unexpected` lists surprises (a connection closed after a message that
    should have left it open, a reply missing, a wrong call id) with a reproduction."""

    name: str
    messages: int = 0
    connections: int = 0
    answered: int = 0
    closed: int = 0
    hung: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    replies: dict[str, int] = field(default_factory=dict)  # engine replies by error code
    unexpected: list[str] = field(default_factory=list)
    hung_cases: list[str] = field(default_factory=list)

    def count(self, kind: str, n: int = 1) -> None:
        self.messages += n
        self.by_kind[kind] = self.by_kind.get(kind, 0) + n

    def surprise(self, what: str) -> None:
        if len(self.unexpected) < 50:
            self.unexpected.append(what)

    def hang(self, what: str) -> None:
        self.hung += 1
        if len(self.hung_cases) < 50:
            self.hung_cases.append(what)

    def summary(self) -> dict[str, object]:
        counts = ("messages", "connections", "answered", "closed", "hung")
        return {
            **{name: getattr(self, name) for name in counts},
            "unexpected": len(self.unexpected),
            "by_kind": dict(sorted(self.by_kind.items())),
            **({"replies": dict(sorted(self.replies.items()))} if self.replies else {}),
        }


def http_status(daemon: DaemonProc) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{daemon.http_address}/v1/status", timeout=10) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


def crash_lines(text: str) -> list[str]:
    """Lines of a daemon log that show an unhandled exception (see CRASH_MARKERS)."""
    return [line for line in text.splitlines() if any(m in line for m in CRASH_MARKERS)]


def forged_lines(text: str) -> list[str]:
    """Log lines a hostile string managed to start (a newline in it reached the log)."""
    return [line for line in text.splitlines() if line.startswith(FORGED_LINE)]


def rss_bytes(daemon: DaemonProc) -> int:
    with open(f"/proc/{daemon.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class LiveResult:
    reports: list[FuzzReport]
    crashed: list[str]
    tracebacks: dict[str, list[str]]
    forged: dict[str, list[str]]
    verified: bool
    verify_detail: str
    rss_before: dict[str, int]
    rss_after: dict[str, int]
    seconds: float

    @property
    def hung(self) -> int:
        return sum(r.hung for r in self.reports)

    def messages(self, prefix: str) -> int:
        return sum(r.messages for r in self.reports if r.name.startswith(prefix))

    @property
    def ok(self) -> bool:
        return (
            not self.crashed
            and not any(self.tracebacks.values())
            and self.hung == 0
            and self.verified
        )

"""systemd's sd_notify protocol, without libsystemd.

Datagrams of newline-separated `KEY=value` lines go to the socket named by
$NOTIFY_SOCKET (a path, or an abstract socket when it starts with '@'). Without
$NOTIFY_SOCKET every call is a no-op, so the daemon behaves the same outside
systemd. What kvxferd sends, and when:

* `STATUS=...` at each lifecycle step (shown by `systemctl status`);
* `READY=1` only once the daemon can serve (data plane, peer listener and
  engine API up), and again after each reload;
* `RELOADING=1` with `MONOTONIC_USEC=<CLOCK_MONOTONIC in µs>` when a SIGHUP
  reload starts (what Type=notify-reload expects);
* `STOPPING=1` when the drain starts;
* `WATCHDOG=1` every half `WATCHDOG_USEC` from an event-loop task, so a
  stalled loop stops the pings and systemd restarts the service; the pings
  stop too while the daemon is unhealthy (/healthz 503: a transport stall
  longer than daemon.stall_unhealthy_s, which only a restart clears). When
  `WATCHDOG_PID` is set and is not this process, no pings are sent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger("kvxferd.sdnotify")


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, the clock systemd compares MONOTONIC_USEC with."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends sd_notify messages; every method is a no-op without $NOTIFY_SOCKET."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = None
        if raw.startswith("@"):
            self.address = "\0" + raw[1:]  # abstract namespace
        elif raw.startswith("/"):
            self.address = raw
        elif raw:
            log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract socket; ignored", raw)
        self.watchdog_s = _watchdog_interval(env)
        self._sock: socket.socket | None = None
        self._failed = False
        self.sent: list[str] = []  # the last few messages, for status and debugging

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send one datagram of `lines`; False when disabled or the send failed."""
        if self.address is None:
            return False
        text = "\n".join(line.replace("\n", " ") for line in lines)
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(text.encode(), self.address)
        except OSError as exc:
            # Logged once: a missing manager must not flood the log at every ping.
            if not self._failed:
                log.warning("sd_notify to %s failed: %s", self.address.lstrip("\0"), exc)
                self._failed = True
            return False
        self.sent = [*self.sent[-9:], text]
        return True

    def status(self, text: str) -> None:
        self.notify(f"STATUS={text}")

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}")

    def reloading(self) -> None:
        self.notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}", "STATUS=reloading")

    def stopping(self, status: str = "draining") -> None:
        self.notify("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    async def watchdog_loop(self, healthy: Callable[[], bool] = lambda: True) -> None:
        """Ping every half watchdog interval for as long as the event loop runs it and
        `healthy` says so (a daemon that needs a restart lets systemd restart it)."""
        if self.watchdog_s is None or self.address is None:
            return
        period = self.watchdog_s / 2
        log.info("systemd watchdog: pinging every %.3f s", period)
        while True:
            if healthy():
                self.watchdog()
            await asyncio.sleep(period)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None  # the watchdog is meant for another process of the unit
    return int(usec) / 1e6

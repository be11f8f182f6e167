"""Helpers for the operations tests: scrape and read /metrics, a fake systemd
NOTIFY_SOCKET that records who sent what, and plain HTTP GETs."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvxferd.sim.cluster import DaemonProc


def http_get(daemon: DaemonProc, path: str) -> tuple[int, str, str]:
    """(status code, content type, body) of a GET on the daemon's HTTP endpoint."""
    try:
        with urllib.request.urlopen(f"http://{daemon.http_address}{path}", timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


def scrape(daemon: DaemonProc) -> str:
    code, ctype, body = http_get(daemon, "/metrics")
    assert code == 200 and ctype.startswith("text/plain"), (code, ctype)
    return body


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(exposition: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, metric: str, /, **labels: str) -> float:
    """One sample's value; a missing series is an error (it names what exists)."""
    key = (metric, frozenset(labels.items()))
    if key not in samples:
        near = sorted(str(dict(k[1])) for k in samples if k[0] == metric)
        raise AssertionError(f"no sample {metric}{labels}; series of {metric}: {near}")
    return samples[key]


def promtool_check(exposition: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool is not None
    return subprocess.run(
        [promtool, "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=60
    )


@dataclass
class Notification:
    pid: int
    fields: dict[str, str]
    at: float

    def has(self, key: str, val: str = "1") -> bool:
        return self.fields.get(key) == val


class NotifyListener:
    """A fake service manager: a datagram socket that reads the sender's pid
    (SO_PASSCRED / SCM_CREDENTIALS) with every message."""

    def __init__(self, abstract: bool = False) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._dir: str | None = None
        if abstract:
            name = f"kvxferd-test-notify-{os.getpid()}-{id(self)}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            self._dir = tempfile.mkdtemp(prefix="kvx-notify-", dir="/tmp")  # short: sun_path
            self.address = os.path.join(self._dir, "notify.sock")
            self.sock.bind(self.address)
        self.received: list[Notification] = []

    def poll(self, timeout_s: float) -> Notification | None:
        self.sock.settimeout(max(timeout_s, 0.001))
        try:
            data, anc, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except TimeoutError:
            return None
        pid = -1
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("iII", payload[:12])[0]
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        n = Notification(pid, fields, time.monotonic())
        self.received.append(n)
        return n

    def wait_for(
        self, predicate: Callable[[Notification], bool], timeout_s: float = 30.0, what: str = ""
    ) -> Notification:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            n = self.poll(deadline - time.monotonic())
            if n is not None and predicate(n):
                return n
        raise AssertionError(
            f"no notification {what} within {timeout_s} s; got {[m.fields for m in self.received]}"
        )

    def drain_for(self, seconds: float) -> list[Notification]:
        """Everything received during `seconds`."""
        got = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            n = self.poll(end - time.monotonic())
            if n is not None:
                got.append(n)
        return got

    def close(self) -> None:
        self.sock.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

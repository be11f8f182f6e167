"""Real daemons and reference engines as separate processes on loopback.

Used by `kvxferd demo`, `kvxferd bench` and the tests: writes a config per
daemon, starts `kvxferd run` processes (peer and HTTP ports chosen by the
kernel and read back from the daemon's log), and runs reference engines.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvxferd.errors import KvxferdError
from kvxferd.memory.layout import KvLayout

# A run that failed gives the daemons still up this long to drain and exit (then kills
# them): a killed peer's holds are fenced at once by its pidfd, so they need a few seconds.
STOP_AFTER_FAILURE_S = 20.0

_LISTEN_RE = re.compile(r"listening for peers on (\S+)")
_HTTP_RE = re.compile(r"HTTP \(health, status\) on (\S+)")

DEFAULT_GEOMETRY: dict[str, Any] = {
    "num_layers": 8,
    "num_kv_heads": 4,
    "head_dim": 64,
    "tokens_per_block": 32,
    "dtype": "float16",
    "layout": "block-major",
}
# The reference engine's geometry flags (kvxferd.sim.engine; kvxferd bench's Geometry has
# the same names), each by the `engine.kv_layout` key of the daemons' configs it mirrors.
GEOMETRY_FLAGS = {
    "layers": "num_layers",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "tokens_per_block": "tokens_per_block",
    "dtype": "dtype",
    "layout": "layout",
}


class ClusterError(KvxferdError):
    pass


def pool_layout(geometry: dict[str, Any], num_blocks: int) -> KvLayout:
    """The layout of an engine pool of `num_blocks` for daemons of `geometry` (a
    LocalCluster's, the daemons' `engine.kv_layout`), with K and V."""
    return KvLayout(
        num_layers=geometry["num_layers"],
        kv_factor=2,
        num_kv_heads=geometry["num_kv_heads"],
        head_dim=geometry["head_dim"],
        tokens_per_block=geometry["tokens_per_block"],
        dtype=geometry["dtype"],
        major=geometry["layout"],
        num_blocks=num_blocks,
    )


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that makes the child (a daemon, an engine) be SIGKILLed when this
    process dies, so that a test run or demo that is killed (a CI timeout) leaves no
    daemons behind. The kernel ties the signal to the thread that forks, so it is armed
    only from the main thread; libc is looked up here, before the fork, and the child
    calls nothing that takes a lock."""
    if (
        not sys.platform.startswith("linux")
        or threading.current_thread() is not threading.main_thread()
    ):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # it died before the signal was armed
            os._exit(1)

    return arm


@dataclass
class DaemonProc:
    name: str
    role: str
    config_path: Path
    api_socket: str
    log_path: Path
    proc: subprocess.Popen[bytes]
    peer_address: str = ""
    http_address: str = ""
    log_offset: int = 0  # where this process's output starts in a shared log file

    def log_text(self) -> str:
        """This process's log output (not that of an earlier daemon of the same name)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful drain) and wait; SIGKILL if it overstays."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)


@dataclass
class LocalCluster:
    workdir: Path
    secret: bytes | None = b"kvxferd-local-cluster-secret"
    geometry: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_GEOMETRY))
    transceiver: dict[str, Any] = field(default_factory=dict)
    daemon_defaults: dict[str, Any] = field(default_factory=dict)
    daemons: list[DaemonProc] = field(default_factory=list)
    # Mutual TLS on the peer channel: each daemon gets a certificate from one test CA
    # under workdir/tls (kvxferd.peers.testca).
    tls: bool = False
    # GPU pools: "vram" gives every daemon engine.kv_memory: vram and every reference
    # engine --memory vram (its pools shared by `vram_share`); "host" writes neither, so
    # a host cluster's configs and commands are what they always were.
    kv_memory: str = "host"
    vram_share: str = "ipc"
    # etcd discovery: the `daemon.etcd` section every daemon gets (at least `endpoints`),
    # with `daemon.discovery: etcd`; None keeps static discovery (daemon.peers). A
    # daemon's own `daemon=` overrides may change single keys of it (`etcd: {...}` merged).
    etcd: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)

    def write_config(
        self,
        name: str,
        role: str,
        *,
        transceiver: dict[str, Any] | None = None,
        daemon: dict[str, Any] | None = None,
        engine: dict[str, Any] | None = None,
        secret: bytes | str | None = "default",
    ) -> tuple[Path, str]:
        api_socket = str(self.workdir / f"{name}.sock")
        daemon_section: dict[str, Any] = {
            "name": name,
            "api_socket": api_socket,
            "peer_listen": "127.0.0.1:0",
            "http": "127.0.0.1:0",
            "heartbeat_interval_ms": 500,
            "heartbeat_timeout_ms": 3000,
            "drain_timeout_ms": 10000,
        }
        the_secret = self.secret if secret == "default" else secret
        if the_secret is not None:
            secret_path = self.workdir / f"{name}.secret"
            secret_path.write_bytes(the_secret if isinstance(the_secret, bytes) else b"")
            secret_path.chmod(0o600)
            daemon_section["shared_secret_file"] = str(secret_path)
        if self.tls:
            from kvxferd.peers import testca

            daemon_section.update(testca.issue(self.workdir / "tls", name).daemon_settings())
        daemon_section.update(self.daemon_defaults)
        overrides = dict(daemon or {})
        if self.etcd is not None:
            daemon_section["discovery"] = "etcd"
            daemon_section["etcd"] = {**self.etcd, **overrides.pop("etcd", {})}
        daemon_section.update(overrides)
        engine_section: dict[str, Any] = {"role": role, "kv_layout": dict(self.geometry)}
        if self.kv_memory != "host":
            engine_section["kv_memory"] = self.kv_memory
        engine_section.update(engine or {})
        ctc: dict[str, Any] = {"backend": "NIXL", "transceiver_runtime": "PYTHON"}
        ctc.update(self.transceiver)
        ctc.update(transceiver or {})
        doc = {"cache_transceiver_config": ctc, "engine": engine_section, "daemon": daemon_section}
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path, daemon_section["api_socket"]

    def start_daemon(
        self, name: str, role: str, *, wait: bool = True, timeout_s: float = 60.0, **kw: Any
    ) -> DaemonProc:
        config_path, api_socket = self.write_config(name, role, **kw)
        log_path = self.workdir / f"{name}.log"
        # A daemon restarted under the same name appends to the same log: only
        # what this process writes counts when reading its addresses back.
        offset = log_path.stat().st_size if log_path.exists() else 0
        log_file = open(log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvxferd.cli", "run", "--config", str(config_path)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent(),  # no daemon outlives a killed test run
        )
        log_file.close()
        d = DaemonProc(name, role, config_path, api_socket, log_path, proc, log_offset=offset)
        self.daemons.append(d)
        if wait:
            self.wait_ready(d, timeout_s)
        return d

    def wait_ready(self, d: DaemonProc, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = d.log_text()
            ready_at = text.rfind(" ready")
            if ready_at >= 0:
                head = text[:ready_at]
                listen = _LISTEN_RE.findall(head)
                http = _HTTP_RE.findall(head)
                d.peer_address = listen[-1] if listen else ""
                d.http_address = http[-1] if http else ""
                if d.peer_address:
                    return
            if not d.alive():
                raise ClusterError(
                    f"daemon {d.name} exited with {d.proc.returncode} before it was ready:\n"
                    + text[-3000:]
                )
            time.sleep(0.05)
        raise ClusterError(
            f"daemon {d.name} not ready after {timeout_s} s:\n{d.log_text()[-3000:]}"
        )

    def engine_command(self, d: DaemonProc | list[DaemonProc], role: str, **opts: Any) -> list[str]:
        """The reference engine of `d`, or of every rank's daemon of a tensor-parallel
        instance (rank order). A list option (the context peers) repeats its flag."""
        daemons = d if isinstance(d, list) else [d]
        cmd = [sys.executable, "-m", "kvxferd.sim.engine", "--role", role]
        for each in daemons:
            cmd += ["--socket", each.api_socket]
        geometry = {flag: self.geometry[key] for flag, key in GEOMETRY_FLAGS.items()}
        if self.kv_memory != "host":
            geometry.update(memory=self.kv_memory, vram_share=self.vram_share)
        for key, value in {**geometry, **opts}.items():
            if value is None or value is False:
                continue
            flag = "--" + key.replace("_", "-")
            if isinstance(value, list):
                for item in value:
                    cmd += [flag, str(item)]
            else:
                cmd += [flag] if value is True else [flag, str(value)]
        return cmd

    def start_engine(
        self,
        d: DaemonProc | list[DaemonProc],
        role: str,
        pass_fds: tuple[int, ...] = (),
        **opts: Any,
    ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.engine_command(d, role, **opts),
            stdout=subprocess.PIPE,
            stderr=None if opts.get("progress") else subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            pass_fds=pass_fds,
            preexec_fn=die_with_parent(),  # no daemon outlives a killed test run
        )

    @staticmethod
    def engine_report(proc: subprocess.Popen[bytes], timeout_s: float = 600.0) -> dict[str, Any]:
        out, err = proc.communicate(timeout=timeout_s)
        return _report(proc.returncode, out, err)

    @staticmethod
    def engine_reports(
        procs: dict[str, subprocess.Popen[bytes]], timeout_s: float = 600.0
    ) -> dict[str, dict[str, Any]]:
        """Every engine's report, by name. The first engine to fail is the one reported
        (named): the others may have failed only because it did (a closed pipe, a peer
        gone), so they are killed rather than waited for. Each engine's output is read
        as it comes (a thread each), so a long report never blocks its writer."""
        ended: queue.Queue[str] = queue.Queue()
        output: dict[str, tuple[bytes, bytes]] = {}
        reports: dict[str, dict[str, Any]] = {}

        def collect(name: str, proc: subprocess.Popen[bytes]) -> None:
            try:
                output[name] = proc.communicate()
            finally:
                ended.put(name)

        threads = [
            threading.Thread(target=collect, args=item, daemon=True) for item in procs.items()
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        try:
            for _ in procs:
                try:
                    name = ended.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise ClusterError("reference engines still running") from None
                reports[name] = _report(procs[name].returncode, *output.get(name, (b"", b"")), name)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
            for t in threads:
                t.join()
        return reports

    def stop_all(self, timeout_s: float = 30.0) -> dict[str, int]:
        codes = {}
        for d in self.daemons:
            codes[d.name] = d.stop(timeout_s)
        return codes

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if exc_type is not None:
                # The run failed (an engine exited, a daemon died): the daemons still up
                # stop as an operator stops them, within a bound, rather than killed: their
                # logs, kept for the user, then end with their drain and say what they
                # still held, and their transports shut down as they do in production.
                self._stop_within(STOP_AFTER_FAILURE_S)
        finally:
            for d in self.daemons:
                if d.alive():
                    d.kill()

    def _stop_within(self, timeout_s: float) -> None:
        """SIGTERM every daemon still up at once, then wait for them until `timeout_s`."""
        running = [d for d in self.daemons if d.alive()]
        for d in running:
            d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for d in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                d.proc.wait(max(0.0, deadline - time.monotonic()))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _report(returncode: int | None, out: bytes, err: bytes, name: str = "") -> dict[str, Any]:
    """A reference engine's JSON report, or ClusterError with the end of its stderr."""
    if returncode != 0:
        raise ClusterError(
            f"reference engine{f' ({name})' if name else ''} exited with {returncode}:\n"
            + (err or b"").decode(errors="replace")[-3000:]
        )
    report: dict[str, Any] = json.loads(out.decode())
    return report


def summarise(ctx_report: dict[str, Any], gen_report: dict[str, Any]) -> dict[str, Any]:
    """Joins both engines' records by request id into the demo/bench summary."""
    sends = {r["request_id"]: r for r in ctx_report["records"]}
    recvs = {r["request_id"]: r for r in gen_report["records"]}
    ids = sorted(set(sends) | set(recvs))
    verified = [i for i in ids if recvs.get(i, {}).get("verified")]
    failed = [
        i
        for i in ids
        if recvs.get(i, {}).get("status") != "done" or sends.get(i, {}).get("status") != "done"
    ]
    latencies = [
        (recvs[i]["t_end_ns"] - sends[i]["t_start_ns"]) / 1e6 for i in verified if i in sends
    ]
    nbytes = sum(recvs[i]["nbytes"] for i in verified)
    starts = [r["t_start_ns"] for r in sends.values() if r["t_start_ns"]]
    ends = [r["t_end_ns"] for r in recvs.values() if r["t_end_ns"]]
    span_s = (max(ends) - min(starts)) / 1e9 if starts and ends else 0.0
    failures: dict[str, int] = {}
    first_failure = ""
    for i in failed:
        key = recvs.get(i, {}).get("reason") or sends.get(i, {}).get("reason") or "unknown"
        failures[key] = failures.get(key, 0) + 1
        if not first_failure:
            # What the daemon said, so that a refusal reads without opening the logs.
            rec = recvs[i] if recvs.get(i, {}).get("status") != "done" else sends.get(i, {})
            first_failure = f"{i}: {key}: {rec.get('message') or '(no message)'}"
    return {
        "requests": len(ids),
        "verified": len(verified),
        "failed": len(failed),
        "unverified": len(ids) - len(verified) - len(failed),
        "bytes": nbytes,
        "seconds": round(span_s, 4),
        "gbps": round(nbytes / span_s / 1e9, 4) if span_s > 0 else 0.0,
        "p50_ms": round(percentile(latencies, 50), 3),
        "p99_ms": round(percentile(latencies, 99), 3),
        "failures": failures,
        "first_failure": first_failure,
        "first_mismatch": next(
            (recvs[i]["verify_error"] for i in ids if recvs.get(i, {}).get("verify_error")), ""
        ),
    }


def default_workdir(prefix: str) -> Path:
    base = Path(os.environ.get("TMPDIR", "/tmp"))
    return Path(
        subprocess.check_output(["mktemp", "-d", str(base / f"{prefix}.XXXXXX")]).decode().strip()
    )

"""A real etcd on loopback for tests and demos: a temporary data dir, ports the kernel
chose, flags that make it ready in well under a second and grant 1-2 s leases.

Debian's etcd-server package (scripts/test-deps.sh installs it) starts no service; this
runs `etcd` by hand, as a child that dies with its parent.
"""

from __future__ import annotations

import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvxferd.sim.cluster import ClusterError, die_with_parent
from kvxferd.sim.ports import free_port

# A 10 ms heartbeat and 100 ms election timeout: a one-member cluster elects itself at
# once (~70 ms to ready, measured) and etcd's minimum lease TTL drops to 1 s.
FAST_FLAGS = ("--heartbeat-interval=10", "--election-timeout=100")


def etcd_binary() -> str | None:
    return shutil.which("etcd")


class EtcdServer:
    """One etcd member. `start`, `kill` (SIGKILL) and `start` again keep the same ports and
    data: a restarted etcd, with the keys and leases it had."""

    def __init__(
        self,
        workdir: Path,
        name: str = "etcd",
        host: str = "127.0.0.1",
        tls: tuple[Path, Path, Path] | None = None,
    ) -> None:
        """`tls`: (CA, certificate, key) to serve clients over TLS, requiring a client
        certificate that CA signed; the certificate must name `localhost` (clients then
        dial `endpoint`, which says localhost)."""
        binary = etcd_binary()
        if binary is None:
            raise ClusterError("no etcd binary (Debian: etcd-server; scripts/test-deps.sh)")
        self.binary = binary
        self.workdir = workdir
        self.name = name
        self.data_dir = workdir / f"{name}.data"
        self.log_path = workdir / f"{name}.log"
        self.host = host  # where it listens for clients (peers: loopback)
        self.tls = tls
        # "user:password" etcdctl authenticates with, once auth is enabled (enable_auth).
        self.user: str | None = None
        self.client_port = free_port(host)
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        host = "localhost" if self.tls is not None and self.host == "127.0.0.1" else self.host
        return f"{host}:{self.client_port}"

    @property
    def _scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def _tls_flags(self) -> list[str]:
        if self.tls is None:
            return []
        ca, cert, key = self.tls
        return [
            f"--cert-file={cert}",
            f"--key-file={key}",
            f"--trusted-ca-file={ca}",
            "--client-cert-auth",
        ]

    def start(self, timeout_s: float = 20.0) -> None:
        listen = f"{self._scheme}://{self.host}:{self.client_port}"
        client = f"{self._scheme}://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--name={self.name}",
                f"--data-dir={self.data_dir}",
                f"--listen-client-urls={listen}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster={self.name}={peer}",
                *FAST_FLAGS,
                *self._tls_flags(),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent(),
        )
        log.close()
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        context = None
        if self.tls is not None:
            ca, cert, key = self.tls
            context = ssl.create_default_context(cafile=str(ca))
            context.load_cert_chain(str(cert), str(key))
        url = f"{self._scheme}://{self.endpoint}/health"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ClusterError(f"etcd exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1, context=context) as r:
                    if b'"true"' in r.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.02)
        raise ClusterError(f"etcd not ready after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def etcdctl(self, *args: str) -> str:
        """Run etcdctl against this member (v3 API); its stdout."""
        binary = shutil.which("etcdctl")
        if binary is None:
            raise ClusterError("no etcdctl binary (Debian: etcd-client; scripts/test-deps.sh)")
        tls = []
        if self.tls is not None:
            ca, cert, key = self.tls
            tls = [f"--cacert={ca}", f"--cert={cert}", f"--key={key}"]
        if self.user is not None:
            tls.append(f"--user={self.user}")
        done = subprocess.run(
            [binary, f"--endpoints={self._scheme}://{self.endpoint}", *tls, *args],
            capture_output=True,
            timeout=30,
            env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
            check=False,
        )
        if done.returncode != 0:
            raise ClusterError(f"etcdctl {' '.join(args)}: {done.stderr.decode(errors='replace')}")
        return done.stdout.decode(errors="replace")

    def enable_auth(self, root_password: str, user: str, password: str, prefix: str) -> None:
        """Turn on etcd's authentication: a root user (etcdctl uses it from then on) and
        `user`, allowed to read and write only keys under `prefix`."""
        self.etcdctl("user", "add", "root", f"--new-user-password={root_password}")
        self.etcdctl("user", "grant-role", "root", "root")
        self.etcdctl("role", "add", "kvxferd")
        self.etcdctl("role", "grant-permission", "kvxferd", "readwrite", "--prefix=true", prefix)
        self.etcdctl("user", "add", user, f"--new-user-password={password}")
        self.etcdctl("user", "grant-role", user, "kvxferd")
        self.etcdctl("auth", "enable")
        self.user = f"root:{root_password}"

"""Network namespaces as hosts.

A Network is a hub namespace holding a bridge, one veth pair per host from the host's
`eth0` to the bridge, and one veth from the root namespace to the bridge (so that the
process running the tests reaches the daemons' HTTP status and etcd). Addresses are
10.77.X.0/24 with X chosen free in the root namespace: .1 is the root namespace, .10 and
up the hosts.

A network namespace alone does not separate hosts for UCX: two processes in different
network namespaces still share System V / POSIX shared memory and can reach each other
with process_vm_writev (cross-memory attach), and UCX picks those over TCP. Each host
is therefore one holder process made by `unshare --ipc --pid --fork --mount --uts` inside
its network namespace, with a private tmpfs on /dev/shm, its own /proc and its own
hostname (the host's name); everything a host runs (its daemons and its reference engine,
which share pools) is entered into the holder's namespaces with nsenter. The hostname
matters to MPI: MPICH tells processes apart by hostname, pid and start second, and every
host's daemon is pid 3 of its namespace, so with one hostname for all, MPI links went to
the wrong daemon.

Names carry the creating process's pid (`kvxh<pid>n<seq>-...`); a run cleans up the
namespaces of earlier runs whose process is gone (a crashed or killed run), and its
own on exit: the holders die with the process that made them (PR_SET_PDEATHSIG, then
`unshare --kill-child`), which takes every process of the host's PID namespace along.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from kvxferd.errors import KvxferdError
from kvxferd.sim.cluster import die_with_parent

NAME_BASE = "kvxh"
_OWNED_RE = re.compile(rf"^{NAME_BASE}(\d+)n\d+-")
_ROOT_LINK_RE = re.compile(rf"^{NAME_BASE}(\d+)r\d+$")
_networks = itertools.count()  # several networks of one process get their own names
HOST_IFACE = "eth0"
SHM_SIZE = "2g"


class NetworkError(KvxferdError):
    pass


def _run(argv: list[str], stdin: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetworkError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


# A host's holder process: its own IPC, PID, mount (a private /dev/shm and /proc) and UTS
# (hostname) namespaces, inside the host's network namespace. The probe makes the same.
_HOLDER_UNSHARE = ("unshare", "--ipc", "--pid", "--fork", "--mount", "--mount-proc", "--uts")


def namespace_problem() -> str | None:
    """Why hosts cannot be made here (None: they can). Checks what is needed for real:
    root, the tools, and that a network namespace and an unshared holder can be made."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the cluster tests as root)"
    for tool in ("ip", "unshare", "nsenter", "nft", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (scripts/test-deps.sh installs it)"
    probe = f"{NAME_BASE}{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except (NetworkError, OSError) as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _run(
            [
                *("ip", "netns", "exec", probe),
                *_HOLDER_UNSHARE,
                *("sh", "-c", "mount -t tmpfs tmpfs /dev/shm && hostname kvxferd-probe"),
            ]
        )
        _run(["ip", "netns", "exec", probe, "nft", "list", "tables"])
    except (NetworkError, OSError) as exc:
        return f"cannot isolate a host (unshare or nftables refused): {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers() -> list[str]:
    """Deletes the namespaces (and the root veths) of earlier runs whose process is gone;
    returns their names. The processes still inside one are killed first."""
    removed = []
    for line in _run(["ip", "netns", "list"], check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        owner = _OWNED_RE.match(name)
        if not owner or _pid_alive(int(owner.group(1))):
            continue
        for pid in _run(["ip", "netns", "pids", name], check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _run(["ip", "netns", "del", name], check=False)
        removed.append(name)
    for line in _run(["ip", "-o", "link", "show"], check=False).splitlines():
        parts = line.split(": ")
        if len(parts) < 2:
            continue
        link = parts[1].split("@")[0]
        owner = _ROOT_LINK_RE.match(link)
        if owner and not _pid_alive(int(owner.group(1))):
            _run(["ip", "link", "del", link], check=False)
            removed.append(link)
    return removed


class HostPopen(subprocess.Popen[bytes]):
    """A process run inside a host through nsenter. nsenter forks to enter the PID
    namespace and does not pass signals on to its child, so signals go to the child
    (`inner_pid`), the process that really runs; waiting and exit status are nsenter's,
    which passes the child's on."""

    inner_pid: int = 0

    def __init__(self, argv: list[str], **kw: Any) -> None:
        super().__init__(argv, **kw)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and self.poll() is None:
            try:
                with open(f"/proc/{self.pid}/task/{self.pid}/children") as f:
                    children = f.read().split()
            except OSError:
                children = []
            if children:
                self.inner_pid = int(children[0])
                return
            time.sleep(0.005)

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        if self.inner_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.inner_pid, sig)
            if sig in (signal.SIGCONT, signal.SIGKILL, signal.SIGTERM):
                # nsenter stops itself when its child stops (to pass the stop on) and
                # waits for a SIGCONT of its own: without one it never reaps the child,
                # and waiting for it hangs (seen: 30 s at the end of tests/cluster after
                # a SIGSTOP/SIGCONT test).
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGCONT)
        else:
            super().send_signal(sig)


@dataclass
class Host:
    """One "machine": a network namespace and a holder process whose IPC, PID and mount
    namespaces (private /dev/shm, own /proc) everything the host runs shares."""

    name: str
    netns: str
    address: str
    holder: subprocess.Popen[bytes] | None = None
    holder_pid: int = 0  # the holder's PID-namespace init, the process to enter

    def command(self, argv: list[str], cwd: str | None = None) -> list[str]:
        """`argv` run inside this host."""
        return [
            *("nsenter", "-t", str(self.holder_pid), "--net", "--ipc", "--mount", "--pid", "--uts"),
            f"--wd={cwd or os.getcwd()}",
            "--",
            *argv,
        ]

    def popen(self, argv: list[str], **kw: Any) -> HostPopen:
        kw.setdefault("preexec_fn", die_with_parent())
        return HostPopen(self.command(argv), **kw)

    def run(self, argv: list[str], stdin: str | None = None, check: bool = True) -> str:
        """A short command (ip, nft, tc) in this host's network namespace."""
        return _run(["nsenter", "-t", str(self.holder_pid), "--net", "--", *argv], stdin, check)

    def iface_bytes(self, iface: str = HOST_IFACE) -> tuple[int, int]:
        """(received, sent) bytes of the host's interface, as its network stack counts."""
        with open(f"/proc/{self.holder_pid}/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == iface:
                    cols = rest.split()
                    return int(cols[0]), int(cols[8])
        raise NetworkError(f"host {self.name} has no interface {iface}")


@dataclass
class Network:
    """`count` hosts on one bridge. Use as a context manager (teardown on any exit)."""

    count: int
    seq: int = field(default_factory=lambda: next(_networks))
    prefix: str = ""  # kvxh<pid>n<seq>
    hosts: list[Host] = field(default_factory=list)
    subnet: str = ""
    root_address: str = ""

    def __post_init__(self) -> None:
        self.prefix = self.prefix or f"{NAME_BASE}{os.getpid()}n{self.seq}"

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    @property
    def root_link(self) -> str:
        # In the root namespace: at most 15 characters (kvxh + 7-digit pid + r + seq).
        return f"{NAME_BASE}{os.getpid()}r{self.seq}"

    def _free_subnet(self) -> str:
        routes = _run(["ip", "-4", "route", "show"], check=False)
        start = os.getpid() % 200
        for step in range(250):
            third = (start + step) % 250 + 1
            if f"10.77.{third}." not in routes:
                return f"10.77.{third}"
        raise NetworkError("no free 10.77.X.0/24 subnet in the root namespace")

    def create(self) -> Network:
        clean_leftovers()
        self.teardown()  # a run of the same pid that died before cleaning up (pid reuse)
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise
        return self

    def _create(self) -> None:
        self.subnet = self._free_subnet()
        self.root_address = f"{self.subnet}.1"
        hub = self.hub
        _run(["ip", "netns", "add", hub])
        _run(["ip", "-n", hub, "link", "set", "lo", "up"])
        _run(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", "br0", "up"])
        # The peer end is made in the hub at once: a name in the root namespace would
        # clash with another run's for a moment.
        _run(
            [
                *("ip", "link", "add", self.root_link, "type", "veth"),
                *("peer", "name", "up0", "netns", hub),
            ]
        )
        _run(["ip", "-n", hub, "link", "set", "up0", "master", "br0", "up"])
        _run(["ip", "addr", "add", f"{self.root_address}/24", "dev", self.root_link])
        _run(["ip", "link", "set", self.root_link, "up"])
        for i in range(self.count):
            host = Host(f"h{i}", f"{self.prefix}-h{i}", f"{self.subnet}.{10 + i}")
            _run(["ip", "netns", "add", host.netns])
            self.hosts.append(host)
            _run(["ip", "-n", host.netns, "link", "set", "lo", "up"])
            _run(
                [
                    *("ip", "-n", hub, "link", "add", f"v{i}", "type", "veth"),
                    *("peer", "name", HOST_IFACE, "netns", host.netns),
                ]
            )
            _run(["ip", "-n", hub, "link", "set", f"v{i}", "master", "br0", "up"])
            _run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", HOST_IFACE])
            _run(["ip", "-n", host.netns, "link", "set", HOST_IFACE, "up"])
            self._start_holder(host)

    def _start_holder(self, host: Host) -> None:
        host.holder = subprocess.Popen(
            [
                *("ip", "netns", "exec", host.netns),
                *_HOLDER_UNSHARE,
                "--kill-child=SIGKILL",
                *(
                    "sh",
                    "-c",
                    f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && hostname {host.name} "
                    "&& exec sleep inf",
                ),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=die_with_parent(),  # the host goes when this process does
        )
        deadline = time.monotonic() + 10.0
        pid = host.holder.pid
        while time.monotonic() < deadline:
            if host.holder.poll() is not None:
                err = host.holder.stderr.read().decode() if host.holder.stderr else ""
                raise NetworkError(f"host {host.name}: the holder exited: {err.strip()}")
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    children = f.read().split()
                if children:
                    inner = int(children[0])
                    # Ready once the private /dev/shm is mounted and `sleep` runs.
                    with open(f"/proc/{inner}/comm") as f:
                        if f.read().strip() == "sleep":
                            host.holder_pid = inner
                            return
            except OSError:
                pass
            time.sleep(0.01)
        raise NetworkError(f"host {host.name}: the holder did not start in 10 s")

    def teardown(self) -> None:
        """Kills every host's processes and deletes the namespaces and the root veth;
        safe to call twice and after a partial create."""
        for host in self.hosts:
            if host.holder is not None and host.holder.poll() is None:
                host.holder.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.holder.wait(10)
        names = [h.netns for h in self.hosts] + [self.hub]
        existing = _run(["ip", "netns", "list"], check=False)
        for line in existing.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(f"{self.prefix}-"):
                names.append(name)
        for name in dict.fromkeys(names):
            if name not in existing:
                continue
            for pid in _run(["ip", "netns", "pids", name], check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run(["ip", "netns", "del", name], check=False)
        _run(["ip", "link", "del", self.root_link], check=False)
        self.hosts = []

    def __enter__(self) -> Network:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.teardown()

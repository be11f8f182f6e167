"""Context and generation instances, one host each, as real daemons and engines.

An instance is one engine's daemons, one per tensor-parallel rank, all on the same
host (a multi-GPU server). Configs, readiness and engine command lines are
LocalCluster's (kvxferd.sim.cluster); what this adds is where processes run: inside a
Host of a Network (each daemon on the host's address, fixed ports, so a daemon restarted
under its name keeps its address), or, without a Network, as plain processes on
loopback (ports chosen by the kernel).

Discovery: with LocalCluster's `etcd` section set, every daemon registers itself in
etcd (its tensor-parallel rank too) and finds the others there alone (no
`daemon.peers`); else it is static, every daemon's `daemon.peers` naming every daemon
of the other role. Generation engines name their context peers by daemon name either way.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from kvxferd.sim.cluster import ClusterError, DaemonProc, LocalCluster, die_with_parent
from kvxferd.sim.hosts.network import Host, Network

PEER_PORT = 7400
HTTP_PORT = 9400


@dataclass
class Instance:
    name: str
    role: str
    tp_size: int
    host: Host | None
    daemons: list[DaemonProc] = field(default_factory=list)

    def rank_name(self, rank: int) -> str:
        return self.name if self.tp_size == 1 else f"{self.name}r{rank}"

    def peer_address(self, rank: int) -> str:
        """Where this rank's daemon listens for peers (known before it starts on a host)."""
        if self.host is not None:
            return f"{self.host.address}:{PEER_PORT + rank}"
        return self.daemons[rank].peer_address


@dataclass
class HostCluster:
    """`local` writes configs and engine commands; `network` (None: loopback) places
    them. Use as a context manager: every process is killed on the way out."""

    local: LocalCluster
    network: Network | None = None
    instances: list[Instance] = field(default_factory=list)
    # daemon section settings of every daemon (heartbeats, timeouts...)
    daemon_settings: dict[str, Any] = field(default_factory=dict)

    @property
    def contexts(self) -> list[Instance]:
        return [i for i in self.instances if i.role == "context"]

    @property
    def generations(self) -> list[Instance]:
        return [i for i in self.instances if i.role == "generation"]

    def plan(self, contexts: int, ctx_tp: int, generations: int, gen_tp: int) -> None:
        """Declares the instances, one host each (contexts first)."""
        hosts = self.network.hosts if self.network is not None else []
        need = contexts + generations
        if hosts and len(hosts) < need:
            raise ClusterError(f"{need} instances need {need} hosts, the network has {len(hosts)}")
        for i in range(need):
            role, tp = ("context", ctx_tp) if i < contexts else ("generation", gen_tp)
            name = f"ctx{i}" if i < contexts else f"gen{i - contexts}"
            self.instances.append(Instance(name, role, tp, hosts[i] if hosts else None))

    def start(self, timeout_s: float = 120.0) -> None:
        """Starts every daemon: all of them at once, then waits for each; on loopback the
        context daemons first, since the generation daemons' peers are their addresses."""
        for group in (self.contexts, self.generations):
            pending = [self._launch(inst, r) for inst in group for r in range(inst.tp_size)]
            for d in pending:
                self.local.wait_ready(d, timeout_s)

    def _static_peers(self, role: str) -> dict[str, str]:
        other = [i for i in self.instances if i.role != role]
        peers = {}
        for inst in other:
            for rank in range(inst.tp_size):
                if inst.host is not None or rank < len(inst.daemons):
                    peers[inst.rank_name(rank)] = inst.peer_address(rank)
        return peers

    def _launch(self, inst: Instance, rank: int) -> DaemonProc:
        name = inst.rank_name(rank)
        daemon: dict[str, Any] = dict(self.daemon_settings)
        if self.local.etcd is not None:
            daemon["etcd"] = {"tp_rank": rank}  # merged into LocalCluster's etcd section
        else:
            daemon["peers"] = self._static_peers(inst.role)
        if inst.host is not None:
            daemon["peer_listen"] = inst.peer_address(rank)
            daemon["http"] = f"{inst.host.address}:{HTTP_PORT + rank}"
        heads = dict(self.local.geometry)
        heads["num_kv_heads"] = heads["num_kv_heads"] // inst.tp_size
        engine = {"tensor_parallel_size": inst.tp_size, "kv_layout": heads}
        config_path, api_socket = self.local.write_config(
            name, inst.role, daemon=daemon, engine=engine
        )
        log_path = self.local.workdir / f"{name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        argv = [sys.executable, "-m", "kvxferd.cli", "run", "--config", str(config_path)]
        with open(log_path, "ab") as log_file:
            opts: dict[str, Any] = {
                "stdout": log_file,
                "stderr": subprocess.STDOUT,
                "stdin": subprocess.DEVNULL,
            }
            proc = (
                inst.host.popen(argv, **opts)
                if inst.host is not None
                else subprocess.Popen(argv, preexec_fn=die_with_parent(), **opts)
            )
        d = DaemonProc(name, inst.role, config_path, api_socket, log_path, proc, log_offset=offset)
        if rank < len(inst.daemons):
            inst.daemons[rank] = d
        else:
            inst.daemons.append(d)
        self.local.daemons.append(d)
        return d

    def restart(self, inst: Instance, rank: int, timeout_s: float = 60.0) -> DaemonProc:
        """A new daemon under the name (and, on a host, the address) of the old one."""
        if inst.daemons[rank].alive():
            raise ClusterError(f"{inst.rank_name(rank)} still runs: kill or stop it first")
        d = self._launch(inst, rank)
        self.local.wait_ready(d, timeout_s)
        return d

    def engine(
        self, inst: Instance, pass_fds: tuple[int, ...] = (), **opts: Any
    ) -> subprocess.Popen[bytes]:
        """The reference engine of `inst`, on its host (sharing the daemons' /dev/shm)."""
        argv = self.local.engine_command(inst.daemons, inst.role, **opts)
        kw: dict[str, Any] = {
            "stdout": subprocess.PIPE,
            "stderr": subprocess.PIPE,
            "stdin": subprocess.DEVNULL,
            "pass_fds": pass_fds,
        }
        if inst.host is not None:
            return inst.host.popen(argv, **kw)
        return subprocess.Popen(argv, preexec_fn=die_with_parent(), **kw)

    def all_daemons(self) -> list[DaemonProc]:
        return [d for inst in self.instances for d in inst.daemons]

    def kill_all(self, timeout_s: float = 30.0) -> None:
        """SIGKILL to every daemon at once, then waits (bounded: on a host the holder's
        end takes whatever is left with it)."""
        for d in self.local.daemons:
            d.proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        for d in self.local.daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                d.proc.wait(max(0.1, deadline - time.monotonic()))

    def __enter__(self) -> HostCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()


def status(d: DaemonProc, timeout_s: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{d.http_address}/v1/status", timeout=timeout_s) as r:
        doc: dict[str, Any] = json.loads(r.read())
    return doc


def leftovers(d: DaemonProc) -> list[str]:
    """What a daemon with no requests should not hold any more (empty: nothing)."""
    doc = status(d)
    found = []
    if doc["sessions"] != {"send": {}, "recv": {}}:
        found.append(f"sessions {doc['sessions']}")
    if doc["open_transfer_handles"]:
        found.append(f"{doc['open_transfer_handles']} open transfer handles")
    adm = doc["admission"]
    if adm["in_flight_blocks"] or adm["waiting"]:
        found.append(f"admission {adm['in_flight_blocks']} blocks, {adm['waiting']} waiting")
    holds = doc["holds"]
    if holds["requests"] or holds["blocks"]:
        found.append(f"{holds['requests']} holds of {holds['blocks']} blocks (unfenced)")
    drains = doc.get("drains", {}).get("active", 0)
    if drains:
        found.append(f"{drains} writes still drained (tx_drains.py)")
    if doc.get("contending_receives"):
        found.append(f"{doc['contending_receives']} contending receives")
    return found


def wait_clean(daemons: list[DaemonProc], timeout_s: float = 30.0) -> dict[str, list[str]]:
    """Polls every live daemon until none holds anything; returns what is left at the
    deadline (empty: all clean). Holds end only when their writer is fenced, so this
    waits, bounded, rather than asserting at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {d.name: leftovers(d) for d in daemons if d.alive()}
        left = {name: what for name, what in left.items() if what}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)

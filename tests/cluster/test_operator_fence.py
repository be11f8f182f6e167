"""A context daemon on another host SIGKILLed mid-round and not started again: the
operator's fence (`kvxferd fence`) ends the holds waiting for it.

The generation daemons cannot watch a process on another host, and a daemon that never
comes back where it was shows no new incarnation: nothing else can tell them that its
writes cannot land any more, so the receives that ended while it may have been writing
keep their blocks (promise 3), and the engines could not deregister their pools. Once
the operator says it is gone, those holds end (`released`, how "operator") and the
engines close cleanly. The fence is refused for a daemon still connected, and says so
when no hold waits for the name.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

from conftest import Cluster, assert_clean, assert_every_outcome

from kvxferd.sim.cluster import DaemonProc
from kvxferd.sim.hosts.cluster import Instance, status
from kvxferd.sim.hosts.traffic import Outcomes

KILLED_REASONS = {"peer_lost", "peer_unreachable", "receiver_timeout", "peer_failed"}


def _fence(inst: Instance, d: DaemonProc, name: str) -> tuple[int, str]:
    """`kvxferd fence` run on the generation daemon's host, as an operator would."""
    assert inst.host is not None
    proc = inst.host.popen(
        [sys.executable, "-m", "kvxferd.cli", "fence", "--socket", d.api_socket, name],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out.decode(errors="replace")


def _holding_for(d: DaemonProc, name: str) -> int:
    return int(status(d)["holds"]["by_peer"].get(name, {}).get("holds", 0))


def _connected_to(d: DaemonProc, name: str) -> bool:
    return any(p["name"] == name for p in status(d)["peers"])


def test_a_context_daemon_gone_for_good_is_fenced_by_the_operator(cluster: Cluster) -> None:
    ctx1 = cluster.hc.contexts[1]
    gens = [(inst, d) for inst in cluster.hc.generations for d in inst.daemons]
    rnd = cluster.round(seed=21).start()
    rnd.wait_announced(rnd.total // 4)

    # Alive and connected (it writes to every generation rank): refused, nothing changes.
    inst, d = gens[0]
    assert _connected_to(d, "ctx0"), status(d)["peers"]
    code, text = _fence(inst, d, "ctx0")
    assert code == 1 and "writer_alive" in text, text

    ctx1.daemons[0].kill(signal.SIGKILL)
    for r in rnd.routes:  # its engines go with it
        if r.ctx is ctx1:
            r.ctx_proc.wait(30)

    finished: list[Outcomes] = []
    failure: list[BaseException] = []

    def finish() -> None:
        try:
            finished.append(rnd.finish())
        except BaseException as exc:  # reported by the test thread
            failure.append(exc)

    waiter = threading.Thread(target=finish, daemon=True)
    waiter.start()
    # The generation engines wait (bounded) for their held blocks before deregistering:
    # meanwhile the operator fences ctx1 wherever memory is held for it and it is gone.
    fenced: dict[str, int] = {}
    deadline = time.monotonic() + 150
    while waiter.is_alive():
        assert time.monotonic() < deadline, "the round did not finish"
        for inst, d in gens:
            if _holding_for(d, "ctx1") and not _connected_to(d, "ctx1"):
                code, text = _fence(inst, d, "ctx1")
                # A hold may have ended between the status and the call.
                assert code == 0 or "nothing_held" in text, text
                if code == 0:
                    fenced[d.name] = fenced.get(d.name, 0) + int(text.split(": ")[1].split()[0])
        waiter.join(0.5)
    assert not failure, failure
    out = finished[0]
    summary = out.to_json()
    assert fenced and sum(fenced.values()) > 0, "no hold waited for the killed daemon"
    killed = {f"{r.label} context engine" for r in rnd.routes if r.ctx is ctx1}
    # Only the killed daemon's own engines failed: the generation engines got their held
    # blocks back and deregistered their pools. Not necessarily all of them: one whose
    # route had sent everything before the kill exits cleanly (seen once in CI).
    failed_engines = {e.split(" exited")[0] for e in out.engine_errors}
    assert failed_engines and failed_engines <= killed, out.engine_errors
    assert not out.wrong and not out.lost, summary
    assert out.verified + sum(out.failed.values()) == rnd.total, summary
    assert out.failed and set(out.failed) <= KILLED_REASONS, summary
    released = {d.name: status(d)["holds"]["released"].get("operator", 0) for _, d in gens}
    assert {name for name, n in released.items() if n} == set(fenced), released

    # Nothing waits for it any more: the fence says so, naming who holds wait for.
    inst, d = gens[0]
    code, text = _fence(inst, d, "ctx1")
    assert code == 1 and "nothing_held" in text and "no hold waits for ctx1" in text, text

    # Back to the whole cluster for the tests after this one.
    cluster.hc.restart(ctx1, 0)
    cluster.wait_old_leases_gone()
    again = cluster.round(requests=8, seed=22).start()
    assert_every_outcome(again.finish(), again.total)
    assert_clean(cluster)

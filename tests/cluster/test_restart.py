"""A context daemon SIGKILLed mid-round and started again under the same name.

Its own engine goes with it (an engine does not outlive its daemon's socket); the
generation side must still give every request of the killed instance's routes an
outcome (failed with a reason: the peer was lost or could not be dialled), lose none,
deliver nothing wrong, and release every hold once the writer is fenced: the dead
process's writes cannot land, and the restarted daemon is a new incarnation. Then the
restarted daemon, at the same address, serves every generation instance again.
"""

from __future__ import annotations

import signal

from conftest import REQUESTS, Cluster, assert_clean, assert_every_outcome

from kvxferd.sim.hosts.cluster import status

KILLED_REASONS = {"peer_lost", "peer_unreachable", "receiver_timeout", "peer_failed"}


def _incarnations(cluster: Cluster, name: str) -> set[str]:
    return {
        p["incarnation"]
        for gen in cluster.hc.generations
        for d in gen.daemons
        for p in status(d)["peers"]
        if p["name"] == name
    }


def test_context_daemon_killed_and_restarted(cluster: Cluster) -> None:
    ctx1 = cluster.hc.contexts[1]
    old = status(ctx1.daemons[0])["incarnation"]
    rnd = cluster.round(seed=8).start()
    rnd.wait_announced(rnd.total // 4)
    ctx1.daemons[0].kill(signal.SIGKILL)
    for r in rnd.routes:  # its engines go with it
        if r.ctx is ctx1:
            r.ctx_proc.wait(30)
    # Restarted at once, as a supervisor would, while the round still runs: the new
    # incarnation is what proves the old one's writes cannot land, so the holds of the
    # receives that failed end only once the generation daemons meet it (by the second
    # round's receives, which name it).
    new = cluster.hc.restart(ctx1, 0)
    assert new.name == "ctx1" and status(new)["incarnation"] != old
    # Once the killed daemon's lease ended and the restarted one registered in its place.
    cluster.wait_old_leases_gone()
    again = cluster.round(requests=max(8, REQUESTS // 2), seed=9).start()
    out = rnd.finish()
    summary = out.to_json()
    # Only the killed daemon's own engines went with it.
    killed = {f"{r.label} context engine" for r in rnd.routes if r.ctx is ctx1}
    assert {e.split(" exited")[0] for e in out.engine_errors} == killed, out.engine_errors
    assert not out.wrong and not out.lost, summary
    assert out.requests == rnd.total, summary
    assert out.verified + sum(out.failed.values()) == rnd.total, summary
    assert out.failed and set(out.failed) <= KILLED_REASONS, summary
    for r in rnd.routes:  # the other context instance's routes were not touched
        if r.ctx is not ctx1:
            assert r.gen_report is not None
            assert all(rec["status"] == "done" for rec in r.gen_report["records"]), r.label
    # The restarted daemon, at the same address, serves every generation instance.
    assert_every_outcome(again.finish(), again.total)
    assert _incarnations(cluster, "ctx1") == {status(new)["incarnation"]}
    assert_clean(cluster)

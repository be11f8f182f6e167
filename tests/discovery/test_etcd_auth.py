"""etcd's own authentication: a daemon with the user and its password file registers;
one with a wrong password serves with discovery down, saying why."""

from __future__ import annotations

from daemon_harness import status, wait_for
from discovery_harness import PREFIX, keys

from kvxferd.sim.cluster import LocalCluster
from kvxferd.sim.etcd_server import EtcdServer


def test_credentials_from_a_password_file(cluster: LocalCluster, etcd: EtcdServer) -> None:
    etcd.enable_auth("root-secret", "kvxferd", "sesame", PREFIX)
    good = cluster.workdir / "etcd-password"
    good.write_text("sesame\n")
    wrong = cluster.workdir / "etcd-wrong"
    wrong.write_text("not-sesame\n")
    creds = {"username": "kvxferd", "connect_timeout_ms": 1000}
    ctx = cluster.start_daemon(
        "ctx", "context", daemon={"etcd": {**creds, "password_file": str(good)}}
    )
    assert keys(etcd)["ctx"]["incarnation"] == status(ctx)["incarnation"]
    wait_for(lambda: status(ctx)["discovery"]["up"] is True, what="ctx's discovery up")
    gen = cluster.start_daemon(
        "gen", "generation", daemon={"etcd": {**creds, "password_file": str(wrong)}}
    )
    disc = status(gen)["discovery"]
    assert disc["up"] is False and disc["registered"] is False, disc
    assert "authenticate" in str(disc["last_error"]), disc
    assert sorted(keys(etcd)) == ["ctx"]

"""TLS to etcd: a real etcd that serves TLS and requires client certificates. Daemons with
the CA and a client certificate register and see each other; one without a client
certificate, or trusting another CA, serves with discovery down, saying why."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import status, wait_for
from discovery_harness import CLUSTER, LEASE_TTL_S, keys, members
from nixl_harness import nixl_or_skip

from kvxferd.peers import testca
from kvxferd.sim.cluster import LocalCluster
from kvxferd.sim.etcd_server import EtcdServer, etcd_binary


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[tuple[EtcdServer, Path]]:
    if etcd_binary() is None or shutil.which("openssl") is None:
        pytest.skip("needs etcd (etcd-server) and openssl (scripts/test-deps.sh)")
    pytest.importorskip("aetcd", reason="the etcd client is the extra `etcd` (scripts/install.sh)")
    certs = tmp_path / "certs"
    ca = testca.make_ca(certs)
    server = testca.issue(certs, "localhost", ca)
    etcd = EtcdServer(tmp_path, tls=(server.ca_file, server.cert_file, server.key_file))
    etcd.start()
    try:
        yield etcd, certs
    finally:
        etcd.kill()


def test_daemons_register_over_tls_with_client_certificates(
    tmp_path: Path, tls_etcd: tuple[EtcdServer, Path]
) -> None:
    nixl_or_skip("the daemon tests need NIXL (scripts/install.sh)")
    etcd, certs = tls_etcd
    client = testca.issue(certs, "kvxferd-client", (certs / "ca.pem", certs / "ca.key"))
    section = {
        "endpoints": [etcd.endpoint],
        "cluster": CLUSTER,
        "lease_ttl_s": LEASE_TTL_S,
        "ca_file": str(client.ca_file),
        "cert_file": str(client.cert_file),
        "key_file": str(client.key_file),
        "connect_timeout_ms": 1000,
    }
    with LocalCluster(tmp_path / "cluster", etcd=section) as cluster:
        cluster.start_daemon("ctx", "context")
        gen = cluster.start_daemon("gen", "generation")
        assert sorted(keys(etcd)) == ["ctx", "gen"]
        wait_for(lambda: members(gen) == ["ctx", "gen"], what="gen sees both over TLS")

        # No client certificate: etcd refuses the connection; the daemon serves anyway.
        bare = cluster.start_daemon(
            "bare", "generation", daemon={"etcd": {"cert_file": None, "key_file": None}}
        )
        # Another CA: the daemon does not trust etcd's certificate.
        other_ca = testca.issue(tmp_path / "other", "kvxferd-client")
        stranger = cluster.start_daemon(
            "stranger",
            "generation",
            daemon={
                "etcd": {
                    "ca_file": str(other_ca.ca_file),
                    "cert_file": str(other_ca.cert_file),
                    "key_file": str(other_ca.key_file),
                }
            },
        )
        for d in (bare, stranger):
            disc = status(d)["discovery"]
            assert disc["up"] is False and disc["registered"] is False, disc
            assert disc["last_error"], disc
            assert status(d)["ready"]
        assert sorted(keys(etcd)) == ["ctx", "gen"]
        assert cluster.stop_all() == {"ctx": 0, "gen": 0, "bare": 0, "stranger": 0}

"""Mutual TLS on the peer control channel, between real daemons.

Both ends present a certificate from the configured CA, and a certificate vouches for one
daemon name: a daemon without TLS, a certificate from another CA, and a certificate used
under another daemon's name are all refused, with the reason in the log, the metrics
(`reason="tls"`) and the refused receive's outcome. A SIGHUP reads the files again, so a
rotated certificate serves new connections, and files that no longer load are refused
while the running certificate stays in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import assert_clean, log_lines, metric, status, wait_for
from test_faults import _cfg, logged, opened

from kvxferd.backends.link_secrets import pair_key
from kvxferd.errors import IncompatiblePeerError
from kvxferd.peers import testca, tls
from kvxferd.peers.handshake import Identity, client_handshake
from kvxferd.peers.messages import Info
from kvxferd.sim.cluster import DaemonProc, LocalCluster

TOKENS = 100
WAIT_S = 20.0
NO_TLS = {"tls_cert_file": None, "tls_key_file": None, "tls_ca_file": None}

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="mutual TLS needs Python 3.11 (StreamWriter.start_tls)"
)


@pytest.fixture
def tls_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    # No shared secret: the certificates alone authenticate the peers.
    with LocalCluster(tmp_path, tls=True, secret=None) as c:
        yield c


def handshake_failures(daemon: DaemonProc, reason: str) -> float:
    return metric(daemon, "kvxferd_handshake_failures_total", 0.0, reason=reason)


async def transfer(ctx: DaemonProc, gen: DaemonProc, rid: str) -> tuple[str, str, bool]:
    """One request from ctx to gen: (status, reason, verified)."""
    async with opened(ctx) as c, opened(gen) as g:
        await c.send(rid, TOKENS)
        blocks = await g.recv(rid, TOKENS, ctx.peer_address)
        out = await g.client.wait(rid, timeout_s=WAIT_S)
        if out.status != "done":
            await c.client.cancel(rid)  # nobody will ask for it: do not wait for its timeout
        sent = await c.client.wait(rid, timeout_s=WAIT_S)
        ok = out.status == "done" and g.verify(rid, blocks, TOKENS).ok
        return out.status, f"{out.reason}: {out.message} / send {sent.status}", ok


def test_tls_pair_moves_verified_kv_and_says_so(tls_cluster: LocalCluster) -> None:
    ctx = tls_cluster.start_daemon("ctx", "context", **_cfg(20000))
    gen = tls_cluster.start_daemon("gen", "generation", **_cfg(20000))
    for i in range(3):
        state, why, ok = asyncio.run(transfer(ctx, gen, f"r-tls-{i}"))
        assert state == "done" and ok, why
    peers = status(gen)["peers"]
    assert len(peers) == 1 and peers[0]["tls"].startswith("TLSv1.3 "), peers
    sec = status(ctx)["peer_security"]
    assert sec["shared_secret"] is False and sec["tls"]["names"] == ["ctx"], sec
    shown = subprocess.run(
        [sys.executable, "-m", "kvxferd.cli", "status", "--address", ctx.http_address],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "mutual TLS as ctx" in shown.stdout and "TLSv1.3" in shown.stdout, shown.stdout
    assert_clean(ctx)
    assert_clean(gen)


def test_a_daemon_without_tls_is_refused_either_way(tls_cluster: LocalCluster) -> None:
    """gen without TLS dials ctx with TLS, and gen2 with TLS dials plain ctx2: both receives
    fail at the handshake with a reason, nothing moves, every daemon serves on."""
    ctx = tls_cluster.start_daemon("ctx", "context", **_cfg(20000))
    plain_gen = tls_cluster.start_daemon("gen", "generation", **_cfg(20000, **NO_TLS), secret=None)
    state, why, _ = asyncio.run(transfer(ctx, plain_gen, "r-plain-to-tls"))
    assert state == "failed" and "requires mutual TLS" in why, why
    # Which of the two the daemon sees depends on when the plain Hello arrives: before
    # the upgrade (sent in clear, refused) or after it (not a TLS record).
    wait_for(
        lambda: any(
            "handshake from" in line and ("sent data in clear" in line or "TLS with" in line)
            for line in ctx.log_text().splitlines()
        ),
        WAIT_S,
        "ctx logs the refused plain handshake",
    )
    wait_for(lambda: handshake_failures(ctx, "tls") >= 1, WAIT_S, "ctx counts a tls failure")

    plain_ctx = tls_cluster.start_daemon("ctx2", "context", **_cfg(20000, **NO_TLS), secret=None)
    gen = tls_cluster.start_daemon("gen2", "generation", **_cfg(20000))
    state, why, _ = asyncio.run(transfer(plain_ctx, gen, "r-tls-to-plain"))
    assert state == "failed" and "StartTls" in why, why
    # A plain daemon never speaks first, and neither does a TLS dialer waiting for StartTls:
    # whichever handshake timeout fires first ends it, the dialer's (a timeout) or the
    # plain daemon's, which closes (the dialer then sees the connection closed before
    # StartTls: a tls failure). Under load either comes first.
    wait_for(
        lambda: handshake_failures(gen, "timeout") + handshake_failures(gen, "tls") >= 1,
        WAIT_S,
        "gen2's dial fails waiting for StartTls",
    )
    for d in (ctx, plain_gen, plain_ctx, gen):
        assert d.alive(), d.log_text()[-2000:]
        assert "Traceback" not in d.log_text(), d.log_text()[-3000:]
    # The TLS pair still works after all that.
    state, why, ok = asyncio.run(transfer(ctx, tls_cluster_gen(tls_cluster, "gen3"), "r-after"))
    assert state == "done" and ok, why


def tls_cluster_gen(cluster: LocalCluster, name: str) -> DaemonProc:
    return cluster.start_daemon(name, "generation", **_cfg(20000))


def test_a_certificate_from_another_ca_is_refused(
    tls_cluster: LocalCluster, tmp_path: Path
) -> None:
    ctx = tls_cluster.start_daemon("ctx", "context", **_cfg(20000))
    stranger = testca.issue(tmp_path / "other-ca", "gen")  # same name, a CA ctx does not know
    gen = tls_cluster.start_daemon("gen", "generation", **_cfg(20000, **stranger.daemon_settings()))
    state, why, _ = asyncio.run(transfer(ctx, gen, "r-other-ca"))
    assert state == "failed", why
    wait_for(lambda: handshake_failures(ctx, "tls") >= 1, WAIT_S, "ctx refuses the stranger")
    wait_for(lambda: handshake_failures(gen, "tls") >= 1, WAIT_S, "gen hears it was refused")
    assert not status(ctx)["peers"]


def _client_context(cert: testca.IssuedCert) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(cert.ca_file))
    ctx.check_hostname = False
    ctx.load_cert_chain(str(cert.cert_file), str(cert.key_file))
    return ctx


async def _tls_hello(
    address: str, cert: testca.IssuedCert, name: str
) -> tuple[bytes, BaseException | None]:
    """Connect with `cert`, then run the kvxferd handshake as daemon `name`: the server's
    certificate (DER), and what the handshake raised (None: it got past the identity)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    names = await tls.dial(reader, writer, tls.TlsPeer(_client_context(cert), address))
    obj = writer.get_extra_info("ssl_object")
    der = obj.getpeercert(binary_form=True)
    me = Identity(name, "1-evil", "generation", b"")

    async def make_info() -> Info:
        raise AssertionError("the handshake must not get this far")

    try:
        await asyncio.wait_for(
            client_handshake(
                reader, writer, me, make_info, lambda p, i: None, address, tls_names=names
            ),
            WAIT_S,
        )
        return der, None
    except Exception as exc:
        return der, exc
    finally:
        writer.close()


async def _info_from(address: str, cert: testca.IssuedCert) -> Info:
    """The Info the daemon at `address` sends a daemon named by `cert` (which then leaves
    without sending its own)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    names = await tls.dial(reader, writer, tls.TlsPeer(_client_context(cert), address))
    got: list[Info] = []

    async def make_info() -> Info:
        raise ConnectionAbortedError("leaving with the peer's Info")

    try:
        with contextlib.suppress(ConnectionAbortedError):
            await asyncio.wait_for(
                client_handshake(
                    reader, writer, Identity("mallory", "1", "generation", b""), make_info,
                    lambda p, i: got.append(i), address, tls_names=names,
                ),
                WAIT_S,
            )  # fmt: skip
    finally:
        writer.close()
    assert len(got) == 1 and len(got[0].link_secret) == 32, got
    return got[0]


def test_a_certificate_under_another_daemons_name_is_refused(tls_cluster: LocalCluster) -> None:
    """gen's certificate (signed by the right CA) used by a process calling itself ctx-b."""
    ctx = tls_cluster.start_daemon("ctx", "context", **_cfg(20000))
    gen_cert = testca.issue(tls_cluster.workdir / "tls", "gen")
    _, raised = asyncio.run(_tls_hello(ctx.peer_address, gen_cert, "ctx-b"))
    assert isinstance(raised, IncompatiblePeerError) and raised.reason == "certificate", raised
    assert "names gen, not ctx-b" in str(raised), raised
    logged(ctx, "says it is ctx-b but its TLS certificate names gen")
    assert handshake_failures(ctx, "tls") >= 1
    assert ctx.alive()


def test_sighup_rotates_the_certificate_and_keeps_it_when_the_new_files_are_bad(
    tls_cluster: LocalCluster,
) -> None:
    ctx = tls_cluster.start_daemon("ctx", "context", **_cfg(20000))
    gen = tls_cluster.start_daemon("gen", "generation", **_cfg(20000))
    state, why, ok = asyncio.run(transfer(ctx, gen, "r-before"))
    assert state == "done" and ok, why
    probe = testca.issue(tls_cluster.workdir / "tls", "probe")
    before, _ = asyncio.run(_tls_hello(ctx.peer_address, probe, "probe"))
    old_fp = status(ctx)["peer_security"]["tls"]["fingerprint"]

    # Rotation: a new certificate and key under the same paths.
    testca.issue(tls_cluster.workdir / "tls", "ctx")
    ctx.proc.send_signal(signal.SIGHUP)
    wait_for(
        lambda: (status(ctx)["config"]["last_reload"] or {}).get("result") == "applied",
        WAIT_S,
        "the rotation reload",
    )
    report = status(ctx)["config"]["last_reload"]
    assert any("certificates reloaded" in line for line in report["applied"]), report
    new_fp = status(ctx)["peer_security"]["tls"]["fingerprint"]
    assert new_fp != old_fp
    after, _ = asyncio.run(_tls_hello(ctx.peer_address, probe, "probe"))
    assert after != before, "a new connection still got the old certificate"

    # A key that does not load: the reload is rejected and the running certificate stays.
    key = tls_cluster.workdir / "tls" / "ctx.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    os.chmod(key, 0o600)
    ctx.proc.send_signal(signal.SIGHUP)
    wait_for(
        lambda: (status(ctx)["config"]["last_reload"] or {}).get("result") == "rejected",
        WAIT_S,
        "the rejected reload",
    )
    problems = status(ctx)["config"]["last_reload"]["problems"]
    assert any("daemon.tls_key_file" in p for p in problems), problems
    assert status(ctx)["peer_security"]["tls"]["fingerprint"] == new_fp
    still, _ = asyncio.run(_tls_hello(ctx.peer_address, probe, "probe"))
    assert still == after
    state, why, ok = asyncio.run(transfer(ctx, gen, "r-after"))
    assert state == "done" and ok, why


def _stranger(
    kind: str, name: str, incarnation: str, peer_key: str, address: str, key: bytes = b""
) -> str:
    """What a client of `address` that never authenticated, naming `name/incarnation` and
    proving `key`, gets (link_stranger.py): LINKED or REFUSED ..."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("link_stranger.py")), kind, name,
         incarnation, peer_key, address, key.hex()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith(("LINKED", "REFUSED"))]
    assert lines, (out.stdout[-2000:], out.stderr[-2000:])
    return lines[-1]


@pytest.mark.parametrize("backend", ["UCX", "MPI"])
def test_tls_without_a_shared_secret_authenticates_two_sided_links_per_pair(
    tmp_path: Path, backend: str
) -> None:
    """Mutual TLS authenticates the peer channel, not UCX's or MPI's own listener (which
    took any client before). Without a shared secret each daemon sends a random secret in
    its Info, over TLS, and a pair's links prove a key made of both: the pair moves
    verified KV; a client of the generation daemon's listener that never authenticated
    makes no link, whether it names the context daemon's key (it cannot prove that pair's
    key) or its own (no Info of it came over TLS); the pair moves KV after them."""
    staged = {"backend": backend, "transceiver_runtime": "CPP"}
    with LocalCluster(tmp_path / "tls", tls=True, secret=None) as c:
        ctx = c.start_daemon("ctx", "context", transceiver=staged)
        gen = c.start_daemon("gen", "generation", transceiver=staged)
        logged(gen, "links prove a key each pair of daemons swapped over TLS")
        state, why, ok = asyncio.run(transfer(ctx, gen, "r-before"))
        assert state == "done" and ok, why
        address = logged(gen, "transport listening on")[0].rsplit(" ", 1)[1]
        gen_key = f"gen/{status(gen)['incarnation']}"
        kind = backend.lower()
        posing = _stranger(kind, "ctx", status(ctx)["incarnation"], gen_key, address)
        assert posing.startswith("REFUSED"), posing
        unknown = _stranger(kind, "stranger", "1", gen_key, address)
        assert unknown.startswith("REFUSED"), unknown
        # A daemon of the cluster (its certificate from the same CA) reads what ctx and gen
        # put in their Info to it; from that it cannot make the key of the pair (ctx, gen).
        mallory = testca.issue(c.workdir / "tls", "mallory")
        ctx_key = f"ctx/{status(ctx)['incarnation']}"
        forged = pair_key(
            (ctx_key, asyncio.run(_info_from(ctx.peer_address, mallory)).link_secret),
            (gen_key, asyncio.run(_info_from(gen.peer_address, mallory)).link_secret),
        )
        insider = _stranger(kind, "ctx", status(ctx)["incarnation"], gen_key, address, forged)
        assert insider.startswith("REFUSED"), insider
        refused = "\n".join(logged(gen, f"{backend}: refused an incoming", count=3))
        assert "ctx/" in refused and "did not prove" in refused, gen.log_text()[-3000:]
        assert "stranger/1" in refused and "has not authenticated" in refused, refused
        state, why, ok = asyncio.run(transfer(ctx, gen, "r-after"))
        assert state == "done" and ok, why
    with LocalCluster(tmp_path / "both", tls=True) as both:
        d = both.start_daemon("gen", "generation", transceiver=staged)
        logged(d, "transport listening on")
        assert not log_lines(d, "swapped over TLS"), d.log_text()[-2000:]

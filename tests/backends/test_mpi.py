"""What is particular to the MPI adapter (kvxferd.backends.mpi), across real
processes on loopback: its process manager, its rendezvous and link lifecycle,
and how a cancelled recv or a dead receiver end. What every two-sided transport
must do, MPI included, is in test_twosided_contract.py; the child-process
harness is twosided_harness.py. Each child is started like a daemon (no
mpiexec) unless a test says otherwise.
"""

from __future__ import annotations

import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from twosided_harness import (
    MIB,
    POSE_ENV,
    REPO,
    connected,
    connected_pair,
    link_carries_a_message,
    stopped_mid_message,
    wait_until,
)
from twosided_harness import MpiChild as Child

from kvxferd.backends.mpi.keepalive import STALL_S
from kvxferd.backends.mpi.transport import DRAIN_S
from kvxferd.backends.mpi.wire import ACK, HELLO, frame

if (_untestable := Child.untestable()) is not None:
    pytest.skip(_untestable, allow_module_level=True)


@pytest.fixture(scope="module")
def shared_pair() -> Iterator[tuple[Child, Child]]:
    """A receiver listening and a sender connected to it, for well-behaved tests."""
    with connected_pair(Child) as rx_tx:
        yield rx_tx


@pytest.fixture
def pair() -> Iterator[tuple[Child, Child]]:
    """A pair of its own, for tests that kill or disconnect a side."""
    with connected_pair(Child) as rx_tx:
        yield rx_tx


def test_both_sides_run_under_a_process_manager_of_their_own(
    shared_pair: tuple[Child, Child],
) -> None:
    """Started without mpiexec, each process got one (MPICH singletons cannot
    connect to each other), and no PMI variable is left for its children."""
    for c in shared_pair:
        info = c.ok("info")
        assert info["mode"] == "bootstrapped", info
        assert info["pmi_env"] == [], info
    # The accept thread ends with the rendezvous.
    rx = shared_pair[0]
    wait_until(lambda: rx.ok("info")["accepting"] == 0, 10, "the accept thread ending")


def test_cancelled_recv_leaves_the_buffer_alone(shared_pair: tuple[Child, Child]) -> None:
    """A recv cancelled before its message came never writes `out`, then or
    later: the payload is received into `out` only by a recv that found its
    header there."""
    rx, tx = shared_pair
    size = 32 * MIB
    recv = rx.submit("recv", peer=tx.key, tag=4, size=size, deadline=30, keep="c")
    rx.submit("cancel", target=recv)
    res = rx.wait(recv, timeout=20)
    assert res["error"] == "CancelledError", res
    # The message still arrives; the next recv of the tag gets it.
    send = tx.submit("send", peer=rx.key, tag=4, size=size, seed=4)
    assert rx.ok("recv", peer=tx.key, tag=4, size=size, deadline=30, seed=4)["verified"]
    assert tx.wait(send, timeout=30)["ok"]
    assert rx.ok("untouched", keep="c")["untouched"]


def test_receiver_killed_fails_the_pending_send(pair: tuple[Child, Child]) -> None:
    """A large send waits for the receiver to take it; the receiver dies instead."""
    rx, tx = pair
    send = tx.submit("send", peer=rx.key, tag=5, size=256 * MIB, seed=5)
    assert tx.event(send) == "sending"
    with pytest.raises(AssertionError, match="no answer"):
        tx.wait(send, timeout=0.5)  # pending: nobody receives it
    rx.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    res = tx.wait(send, timeout=15)
    assert res["error"] == "PeerLostError", res
    assert time.monotonic() - killed < 10
    res = tx.call("send", peer=rx.key, tag=6, size=10, seed=6)
    assert res["error"] == "PeerLostError", res
    # MPI never ends that send; once the dead peer's end of the link came, it is given up.
    wait_until(lambda: tx.ok("info")["requests_in_progress"] == 0, 10, "the send given up")


def test_a_sender_killed_mid_message_gives_the_receive_buffer_back(
    pair: tuple[Child, Child],
) -> None:
    """The recv fails at once, its buffer lent to MPI; once the sender's process is gone
    nothing more can land there, and the buffer comes back. Nothing spins meanwhile:
    MPI never ends that receive (nor a send to a dead peer), and testing it back to back
    held a core for good."""
    rx, tx = pair
    recv = stopped_mid_message(rx, tx, tag=11, deadline=60)
    tx.proc.send_signal(signal.SIGKILL)
    tx.proc.wait()
    res = rx.wait(recv, timeout=15)
    assert res["error"] == "PeerLostError" and res["lent"], res
    wait_until(lambda: not rx.ok("lent", target=recv)["lent"], 15, "the buffer coming back")
    assert rx.ok("info")["requests_in_progress"] == 0
    assert rx.ok("idle_cpu", seconds=1.0)["percent"] < 25


def test_a_sender_stopped_mid_message_keeps_the_buffer_lent_until_it_finishes(
    pair: tuple[Child, Child],
) -> None:
    """Past its stall grace the recv fails and rx closes the link, but a stopped sender's
    MPI goes on sending once it resumes: the buffer stays lent until the message is in."""
    rx, tx = pair
    recv = stopped_mid_message(rx, tx, tag=12, deadline=3)
    try:
        res = rx.wait(recv, timeout=30)  # stall_grace_s (2 s) past its deadline
        assert res["error"] == "PeerLostError" and "stalled" in res["msg"] and res["lent"], res
        wait_until(lambda: rx.ok("info")["peers"] == [], 10, "rx closing the link")
        time.sleep(2 * DRAIN_S)  # what a dead sender's link would have had
        assert rx.ok("lent", target=recv)["lent"]
    finally:
        tx.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: not rx.ok("lent", target=recv)["lent"], 60, "the message finishing")
    assert rx.ok("info")["requests_in_progress"] == 0


def test_a_sender_stopped_then_killed_mid_message_gives_the_buffer_back(
    pair: tuple[Child, Child],
) -> None:
    """rx gives a stopped sender's link up (its GAVE_UP unread there); the sender then dies,
    and its kernel resets the connection rather than closing it: that is its end too."""
    rx, tx = pair
    # The deadline runs from the receive's post, and letting the stopped sender land part
    # of the message takes a while on a loaded host: at 3 s the receive once gave up before
    # the helper could see it mid-message (CI, 2 cores).
    recv = stopped_mid_message(rx, tx, tag=13, deadline=10)
    res = rx.wait(recv, timeout=30)
    assert res["error"] == "PeerLostError" and "stalled" in res["msg"] and res["lent"], res
    wait_until(lambda: rx.ok("info")["peers"] == [], 10, "rx closing the link")
    assert rx.ok("lent", target=recv)["lent"]
    tx.proc.send_signal(signal.SIGKILL)
    tx.proc.wait()
    wait_until(lambda: not rx.ok("lent", target=recv)["lent"], 15, "the buffer coming back")
    assert rx.ok("info")["requests_in_progress"] == 0


def test_a_live_peer_whose_mpi_messages_stop_arriving_is_reported_stalled(
    pair: tuple[Child, Child],
) -> None:
    """keepalive.py: a peer whose TCP keepalives come while nothing comes over its MPI is
    reported stalled (on a real host: this side's receive queue held up by a process
    stopped or killed inside a shared-memory send, benchmarks/mpi_shm_stall.py), with one
    log line saying why and what to do, and is not given up; once its MPI delivers again
    the report clears and messages cross. A peer that is stopped sends neither keepalive:
    that is not a stall (its heartbeat, the daemon's, decides about it)."""
    rx, tx = pair
    assert rx.ok("info")["stalled"] == {}
    tx.ok("mute_mpi_keepalives", mute=True)
    wait_until(lambda: tx.key in rx.ok("info")["stalled"], 30, "rx reporting tx stalled")
    assert rx.ok("info")["peers"] == [tx.key]  # reported, not given up
    wait_until(
        lambda: "has arrived over MPI" in rx.stderr_text(), 10, "the log line naming the stall"
    )
    assert "UCX_TLS=^sm" in rx.stderr_text()
    tx.ok("mute_mpi_keepalives", mute=False)
    wait_until(lambda: rx.ok("info")["stalled"] == {}, 30, "the stall clearing")
    wait_until(lambda: "arrive again" in rx.stderr_text(), 10, "the log line of its end")
    send = tx.submit("send", peer=rx.key, tag=31, size=1000, seed=31)
    assert rx.ok("recv", peer=tx.key, tag=31, size=1000, deadline=20, seed=31)["verified"]
    assert tx.wait(send)["ok"]
    # Stopped: neither keepalive comes, for longer than a stall takes to be reported; nor
    # is it one once it resumes (its TCP keepalive may be read before its MPI one).
    tx.proc.send_signal(signal.SIGSTOP)
    try:
        watch_until = time.monotonic() + 2 * STALL_S
        while time.monotonic() < watch_until:
            assert rx.ok("info")["stalled"] == {}
            time.sleep(0.2)
    finally:
        tx.proc.send_signal(signal.SIGCONT)
    send = tx.submit("send", peer=rx.key, tag=32, size=1000, seed=32)
    assert rx.ok("recv", peer=tx.key, tag=32, size=1000, deadline=20, seed=32)["verified"]
    assert tx.wait(send)["ok"]
    watch_until = time.monotonic() + 2
    while time.monotonic() < watch_until:
        assert rx.ok("info")["stalled"] == {}
        time.sleep(0.2)
    assert rx.stderr_text().count("has arrived over MPI") == 1


def test_a_flood_of_keepalives_gives_the_link_up(pair: tuple[Child, Child]) -> None:
    """A peer writing keepalive bytes by the thousand is not a kvxferd peer keeping a link
    alive (one a second): the link is given up as carrying data, and a new one works."""
    rx, tx = pair
    assert rx.ok("info")["peers"] == [tx.key]
    tx.ok("flood_alive", count=100_000)
    wait_until(lambda: rx.ok("info")["peers"] == [], 20, "rx giving the flooded link up")
    assert rx.proc.poll() is None
    link_carries_a_message(tx, rx, rx.address, tag=41)


def test_removed_peer_fails_pending_receives_and_tells_the_peer(
    pair: tuple[Child, Child],
) -> None:
    rx, tx = pair
    recv = rx.submit("recv", peer=tx.key, tag=5, size=10, deadline=30, keep="r")
    back = tx.submit("recv", peer=rx.key, tag=6, size=10, deadline=30)
    time.sleep(0.2)
    rx.ok("remove_peer", peer=tx.key)
    res = rx.wait(recv, timeout=10)
    assert res["error"] == "PeerLostError", res
    # The peer hears of it (its end of the link closes) and fails its own.
    res = tx.wait(back, timeout=10)
    assert res["error"] == "PeerLostError", res
    assert rx.ok("untouched", keep="r")["untouched"]
    # And it can connect again.
    assert tx.ok("info")["peers"] == []
    tx.ok("remove_peer", peer=rx.key)
    tx.ok("connect", peer=rx.key, address=rx.address)
    send = tx.submit("send", peer=rx.key, tag=5, size=1000, seed=5)
    assert rx.ok("recv", peer=tx.key, tag=5, size=1000, deadline=20, seed=5)["verified"]
    assert tx.wait(send)["ok"]


def _close_the_link_by_a_cancelled_send(closer: Child, peer: Child, tag: int) -> None:
    """`closer` sends what nobody receives and cancels it; stall_grace_s later
    it closes the link, and `peer` sees it closed."""
    back = closer.submit("send", peer=peer.key, tag=tag, size=64 * MIB, seed=tag)
    assert closer.event(back) == "sending"
    time.sleep(0.3)  # the send is under way, nobody receiving it
    closer.submit("cancel", target=back)
    assert closer.wait(back, timeout=20)["error"] == "CancelledError"
    wait_until(lambda: peer.ok("info")["peers"] == [], 10, "the peer seeing the link closed")
    time.sleep(0.2)  # the closer's tick completes its cancelled header receive


def test_a_link_closed_by_its_own_side_leaves_no_stale_header() -> None:
    """Closing a link cancels its pending header receive; that receive, once
    complete, is not a header. It was read as one: the last header that came
    over the link went back into the table (a later recv of that tag, over the
    next link, took it and failed), or, where none had come, it was logged as
    a malformed header."""
    rx, tx = Child("gen"), Child("ctx")
    try:
        connected(rx, tx)
        send = tx.submit("send", peer=rx.key, tag=7, size=1000, seed=7)
        assert rx.ok("recv", peer=tx.key, tag=7, size=1000, deadline=20, seed=7)["verified"]
        assert tx.wait(send)["ok"]
        # A send nobody receives, cancelled: stall_grace_s later rx closes the link.
        _close_the_link_by_a_cancelled_send(rx, tx, tag=8)
        tx.ok("remove_peer", peer=rx.key)
        tx.ok("connect", peer=rx.key, address=rx.address)
        send = tx.submit("send", peer=rx.key, tag=7, size=1000, seed=70)
        res = rx.call("recv", peer=tx.key, tag=7, size=1000, deadline=20, seed=70)
        assert res["ok"] and res["verified"], res
        assert tx.wait(send)["ok"]
        # The same from tx, which never received over its link.
        _close_the_link_by_a_cancelled_send(tx, rx, tag=9)
        err = rx.stderr_text() + tx.stderr_text()
        assert err.count("cancelled and not done") == 2 and "malformed" not in err, err
    finally:
        tx.stop()
        rx.stop()


def _mpich_shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("mpich_shm_*")}


def test_a_connector_that_vanishes_mid_rendezvous_leaves_no_accept_spinning() -> None:
    """A client that says hello, takes the MPI port and disappears: the
    listener's MPI_Comm_accept is released (it would spin forever), and the
    listener still takes real peers. The throwaway process that releases the
    accept leaves no /dev/shm file behind (it exits without MPI_Finalize)."""
    rx = Child("gen")
    try:
        before = _mpich_shm_files()
        host, port = rx.ok("start")["address"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(frame(HELLO, b"ghost/1", b"nonce of 16 byte"))
            head = s.recv(7)
            assert head[:4] == b"KVXM" and head[5] == ACK, head
            (n,) = struct.unpack("!H", s.recv(2))
            s.recv(n)
        wait_until(lambda: rx.ok("info")["accepting"] == 0, 60, "the abandoned accept ending")
        # Other tests' MPI processes make (and unlink) such files too: only one that stays
        # is a leak.
        wait_until(
            lambda: not _mpich_shm_files() - before, 30, "no mpich_shm file left by the release"
        )
        tx = Child("ctx")
        try:
            link_carries_a_message(tx, rx, f"{host}:{port}", tag=1)
        finally:
            tx.stop()
    finally:
        rx.stop()


def frame_hello(name: bytes) -> bytes:
    return frame(HELLO, name, b"nonce of 16 byte")


def _ghost_hello(host: str, port: int, name: bytes) -> socket.socket:
    """A stranger from 127.0.0.2 that says hello to the MPI listener (and reads nothing)."""
    s = socket.create_connection((host, port), timeout=60, source_address=("127.0.0.2", 0))
    s.sendall(frame_hello(name))
    return s


def _take_ack(s: socket.socket) -> None:
    """Wait for the listener's ACK (the accept turn came), then leave without connecting."""
    head = s.recv(7, socket.MSG_WAITALL)
    assert head[:4] == b"KVXM" and head[5] == ACK, head
    s.close()


def test_a_stranger_holding_the_mpi_port_does_not_stop_the_daemon() -> None:
    """A stranger says hello, takes the MPI port, and neither connects nor closes. While
    an MPI_Comm_accept waits, every other MPI call of the process waits (MPICH), and the
    listener's timeout ran on the event loop: the daemon's next MPI call (its tick) stopped
    the loop for good, engine API and all. Now the loop makes no MPI call while the accept
    waits (it answers, the accept still waiting), and the accept is released without
    the loop after ACCEPT_WINDOW_S; then the live link carries a message."""
    from kvxferd.backends.mpi.accepts import ACCEPT_WINDOW_S

    rx, tx = Child("gen"), Child("ctx")
    try:
        address = rx.ok("start")["address"]
        host, port = address.rsplit(":", 1)
        link_carries_a_message(tx, rx, address, tag=1)
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(frame_hello(b"ghost/1"))
            head = s.recv(7, socket.MSG_WAITALL)
            assert head[5] == ACK, head
            # Three answers in a row that saw the accept waiting: the loop went on
            # (each waits past several ticks of 5 ms). Before, none came.
            for _ in range(3):
                answer = rx.answer_within(rx.submit("info"), 30)
                assert answer is not None, "the daemon stopped while the accept waited"
                assert answer["accepting"] == 1, answer
            # The accept ends after its window, the stranger still there.
            wait_until(lambda: rx.ok("info")["accepting"] == 0, 60, "the accept released")
            while s.recv(4096):  # the rest of the ACK, then the listener's close
                pass
        # Its address now waits before its next rendezvous is taken (1 s, doubling).
        assert rx.ok("info")["penalized"] == ["127.0.0.1"]
        assert f"did not complete MPI_Comm_connect within {ACCEPT_WINDOW_S:g} s" in (
            rx.stderr_text()
        )
        link_carries_a_message(tx, rx, address, tag=2)
    finally:
        tx.stop()
        rx.stop()


def test_two_daemons_linking_to_each_other_at_once_both_link() -> None:
    """Each side's accept waited for its own connect, which waited for the other side's
    accept (an MPI_Comm_connect beside the process's own waiting accept never completes):
    both gave up, and on 83a057c both processes died (SIGSEGV) in 2 of 3 runs. Now the
    listener with the larger key refuses the crossing hello, and that side waits for the
    other's link: three rounds, each linked both ways, a message across."""
    a, b = Child("gen"), Child("ctx")
    try:
        a_at, b_at = a.ok("start")["address"], b.ok("start")["address"]
        for round_ in range(3):
            ca = a.submit("connect", peer=b.key, address=b_at, deadline=10.0)
            cb = b.submit("connect", peer=a.key, address=a_at, deadline=10.0)
            assert a.wait(ca, 60)["ok"] and b.wait(cb, 60)["ok"]
            link_carries_a_message(a, b, b_at, tag=10 + round_)
            a.ok("remove_peer", peer=b.key)
            b.ok("remove_peer", peer=a.key)
        assert a.proc.poll() is None and b.proc.poll() is None
    finally:
        a.stop()
        b.stop()


def test_a_connect_waits_for_our_own_accept_beside_it() -> None:
    """A silent stranger holds tx's own listener (its accept waits) while tx links to rx.
    A connect beside the process's own waiting accept never completes, and the connect
    it left queued at rx's port crashed rx's next accept (SIGSEGV, 3 of 3 runs with the
    first version of this change). Now tx's connect waits for that accept to be released
    and then links."""
    rx, tx = Child("gen"), Child("ctx")
    try:
        rx_at, tx_at = rx.ok("start")["address"], tx.ok("start")["address"]
        host, port = tx_at.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(frame_hello(b"ghost/1"))
            assert s.recv(7, socket.MSG_WAITALL)[5] == ACK
            wait_until(lambda: tx.ok("info")["accepting"] == 1, 20, "tx's accept waiting")
            link_carries_a_message(tx, rx, rx_at, tag=1)
        assert rx.proc.poll() is None and tx.proc.poll() is None
    finally:
        tx.stop()
        rx.stop()


@pytest.mark.parametrize("then", ["at_once", "after_it_gave_up"])
def test_a_peer_connecting_after_the_window_leaves_the_listener_whole(then: str) -> None:
    """A peer that takes the ACK and connects only after the accept window: its late
    connect stayed queued at the port, whose name MPICH gives the next MPI_Open_port,
    and the next rendezvous there failed, or, once the late connect had given up,
    crashed the listener (SIGSEGV, 2 of 2). A released accept's port is retired now:
    the next peer links, at once or after the late one gave up."""
    from kvxferd.backends.mpi.accepts import ACCEPT_WINDOW_S

    rx, tx = Child("gen"), Child("ctx")
    try:
        address = rx.ok("start")["address"]
        host, port = address.rsplit(":", 1)
        slow = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("mpi_slow_peer.py")), host, port,
             str(ACCEPT_WINDOW_S + 0.2)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert slow.stdout is not None and slow.stdout.readline().strip() == "ACK"
            wait_until(lambda: rx.ok("info")["accepting"] == 0, 60, "the accept released")
            if then == "after_it_gave_up":
                # The late connect is the slow peer's or, when the slow peer won the
                # accept, the releasing process's: both end at MPICH's connect timeout.
                slow.wait(60)
                wait_until(lambda: rx.ok("info")["releasing"] == 0, 60, "the release ended")
            link_carries_a_message(tx, rx, address, tag=1)
        finally:
            slow.kill()
            slow.wait()
        assert rx.proc.poll() is None and tx.proc.poll() is None
    finally:
        tx.stop()
        rx.stop()


def test_abandoned_rendezvous_take_turns_and_a_real_peer_is_not_queued_behind_them() -> None:
    """Strangers that say hello, take the MPI port and leave: each leaves an
    MPI_Comm_accept that a throwaway process must release. The accept turn was handed on
    at once, so the next stranger's accept ran beside the one being released (four
    strangers looping kept up to five accepts and five releasing processes alive; MPICH
    may take the process down when two accepts overlap). Now an abandoned accept keeps
    the turn until released: one accept at a time. And the turn goes
    round the source addresses: a real peer that queued behind eight strangers from one
    address is served after at most one of them (first come, first served, it came last).
    And an address that abandoned rendezvous waits before its next one is taken."""
    rx, tx = Child("gen"), Child("ctx")
    ghosts: list[socket.socket] = []
    try:
        address = rx.ok("start")["address"]
        host, port = address.rsplit(":", 1)
        first = _ghost_hello(host, int(port), b"ghost/0")
        wait_until(lambda: rx.ok("info")["accepting"] == 1, 20, "the first stranger's accept")
        ghosts = [_ghost_hello(host, int(port), b"ghost/%d" % i) for i in range(1, 9)]
        wait_until(lambda: rx.ok("info")["accept_waiting"] == 8, 20, "the strangers queued")
        connect = tx.submit("connect", peer=rx.key, address=address)
        wait_until(lambda: rx.ok("info")["accept_waiting"] == 9, 20, "the real peer queued")
        _take_ack(first)
        served: list[str] = []
        linked: dict[str, object] | None = None
        left = list(enumerate(ghosts, 1))
        peak_accepting = peak_releasing = 0
        deadline = time.monotonic() + 120
        while left or "peer" not in served:
            assert time.monotonic() < deadline, served
            info = rx.ok("info")
            peak_accepting = max(peak_accepting, info["accepting"])
            peak_releasing = max(peak_releasing, info["releasing"])
            if linked is None:
                linked = tx.answer_within(connect, 0)
                if linked is not None:
                    served.append("peer")
            for i, g in list(left):
                g.settimeout(0.02)
                try:
                    _take_ack(g)
                except TimeoutError:
                    continue
                served.append(f"ghost/{i}")
                left.remove((i, g))
        assert linked is not None and linked["ok"], linked
        # The peer's accept completes before its link is confirmed: a stranger served
        # after it may already have its ACK by then.
        assert served.index("peer") <= 2, served
        # One accept at a time; a releasing process may still be exiting as the next
        # release begins (the accept it ended is done), never more.
        assert peak_accepting <= 1 and peak_releasing <= 2, (peak_accepting, peak_releasing)
        wait_until(lambda: rx.ok("info")["accepting"] == 0, 60, "the last release")
        link_carries_a_message(tx, rx, address, tag=1)
        # The strangers' address abandoned nine rendezvous: its next hello waits,
        # although the turn is free, while a peer from elsewhere links.
        ghosts.append(_ghost_hello(host, int(port), b"ghost/late"))
        wait_until(lambda: rx.ok("info")["accept_waiting"] == 1, 20, "the late hello held")
        other = Child("ctx2")
        try:
            link_carries_a_message(other, rx, address, tag=2)
        finally:
            other.stop()
        info = rx.ok("info")
        assert info["accept_waiting"] == 1 and info["accepting"] == 0, info
    finally:
        for g in ghosts:
            g.close()
        tx.stop()
        rx.stop()


@pytest.mark.parametrize("poser", ["connecting", "listening"])
def test_a_link_whose_mpi_side_is_another_daemon_is_refused_saying_so(poser: str) -> None:
    """The rendezvous (TCP) names one daemon, and the new intercommunicator delivers to
    another: what MPICH did when daemons looked alike to it. Each side checks the key
    that comes over MPI, so the link is refused at once, by the side that saw it, naming
    both daemons; the connecting side hears why; a link between honest daemons is
    made as before, and carries a message."""
    pose = {POSE_ENV: "gen9/77"}
    rx = Child("gen", env=pose if poser == "listening" else None)
    tx = Child("ctx", env=pose if poser == "connecting" else None)
    try:
        rx.address = rx.ok("start")["address"]
        res = tx.call("connect", peer=rx.key, address=rx.address)
        assert not res["ok"], res
        if poser == "connecting":
            # The listener refused it and said why over the rendezvous.
            assert "the peer refused the link" in res["msg"], res
            assert "reached 'gen9/77' instead" in res["msg"], res
            assert f"new MPI link to {tx.key}" in res["msg"], res
            logged = lambda: "reached 'gen9/77'" in rx.stderr_text()  # noqa: E731
            wait_until(logged, 10, "the listener's log line")
        else:
            assert f"new MPI link to {rx.key} reached 'gen9/77' instead" in res["msg"], res
        assert "look alike to MPICH" in res["msg"], res
        assert tx.ok("info")["peers"] == []
        wait_until(lambda: rx.ok("info")["peers"] == [], 10, "the listener to drop the link")
        # The honest side of the pair still links with an honest daemon.
        honest = Child("gen2") if poser == "listening" else Child("ctx2")
        to, by = (honest, tx) if poser == "listening" else (rx, honest)
        try:
            if to is honest:
                to.address = to.ok("start")["address"]
            link_carries_a_message(by, to, to.address, tag=3)
        finally:
            honest.stop()
    finally:
        tx.stop()
        rx.stop()


def test_a_daemon_under_mpiexec_and_a_singleton_connect() -> None:
    """Started by `mpiexec -n 1` the adapter uses that process manager; with
    the bootstrap off a process is an MPI singleton, which can still connect
    to a peer that has a process manager."""
    from kvxferd.backends.mpi.bootstrap import find_mpiexec

    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec")
    rx = Child("gen", prefix=[mpiexec, "-n", "1"])
    tx = Child("ctx", env={"KVXFERD_MPI_BOOTSTRAP": "off"})
    try:
        connected(rx, tx)
        assert rx.ok("info")["mode"] == "process manager"
        assert tx.ok("info")["mode"] == "singleton"
        send = tx.submit("send", peer=rx.key, tag=2, size=3 * MIB, seed=2)
        assert rx.ok("recv", peer=tx.key, tag=2, size=3 * MIB, deadline=20, seed=2)["verified"]
        assert tx.wait(send)["ok"]
    finally:
        tx.stop()
        rx.stop()


def test_the_registry_builds_it_lazily() -> None:
    """MPI is a two-sided backend; importing the registry loads neither the
    adapter nor mpi4py (a NIXL daemon never loads MPI)."""
    code = (
        "import sys; from kvxferd.backends import registry; "
        "assert registry.is_two_sided('MPI'); "
        "assert 'kvxferd.backends.mpi' not in sys.modules and 'mpi4py' not in sys.modules; "
        "t = registry.make_transport('MPI', 'd', '1'); "
        "assert 'mpi4py.MPI' not in sys.modules, 'MPI loads on first use only'; "
        "print(type(t).__name__)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert res.returncode == 0 and "MpiTransport" in res.stdout, res.stderr[-2000:]

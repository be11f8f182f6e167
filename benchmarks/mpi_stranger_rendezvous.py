"""What strangers of the MPI rendezvous port cost a daemon's MPI transport (not issue 16).

Two scenarios, each against a transport child of tests/backends/twosided_harness.py run
from a checkout (this one, or `--base DIR` beside it, alternating):

* `silent`: a peer is linked; a stranger says hello, takes the ACK (the MPI port) and
  neither connects nor closes. How long the child's event loop went without answering
  (an "info" every 0.1 s, each waited for up to 20 s), and whether a 1000-byte message
  over the live link then arrives. Before 2026-12-08 the loop stopped for good at its
  next MPI call (the accept holds MPICH's lock; the listener's timeout ran on the loop).
* `loop`: four strangers say hello, take the ACK and close, again and again for
  `--seconds`: the most MPI_Comm_accept threads and releasing processes alive at once
  (MPICH may take the process down when two accepts overlap), and the rendezvous served.
* `stalled`: a peer is linked; the child then dials a listener that was stopped
  (SIGSTOP) just after it handed out its MPI port. When a message to the live peer
  arrives, how long the child's loop went without answering, and when the dial failed.
* `mutual`: two transports link to each other at once, three rounds: which linked both
  ways, and whether a process died.

    .venv/bin/python benchmarks/mpi_stranger_rendezvous.py [--base DIR] [--seconds 10]
        [--scenarios silent loop stalled mutual]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Run inside the checkout under test (its harness, its kvxferd).
PROBE = textwrap.dedent(
    """
    import json, socket, struct, sys, threading, time
    from pathlib import Path
    sys.path.insert(0, "tests/backends")
    from twosided_harness import MpiChild as Child, link_carries_a_message
    from kvxferd.backends.mpi.wire import HELLO, frame
    scenario, seconds = sys.argv[1], float(sys.argv[2])

    def hello(host, port, name):
        s = socket.create_connection((host, port), timeout=60)
        s.sendall(frame(HELLO, name, b"nonce of 16 byte"))
        head = s.recv(7, socket.MSG_WAITALL)
        assert head[5] == 2, head
        return s

    def releasers():
        # The throwaway processes that end abandoned accepts (python, not mpiexec).
        n = 0
        for p in Path("/proc").glob("[0-9]*"):
            try:
                argv = (p / "cmdline").read_bytes().split(bytes(1))
            except OSError:
                continue
            if "python" in argv[0].decode(errors="replace") and any(
                b"COMM_SELF.Connect(sys.argv[1])" in a for a in argv
            ):
                n += 1
        return n

    out = {}
    rx, tx = Child("gen"), Child("ctx")
    try:
        address = rx.ok("start")["address"]
        host, port = address.rsplit(":", 1)
        if scenario == "silent":
            link_carries_a_message(tx, rx, address, tag=1)
            s = hello(host, int(port), b"ghost/1")
            t0, worst, last = time.monotonic(), 0.0, time.monotonic()
            while time.monotonic() - t0 < seconds:
                answer = rx.answer_within(rx.submit("info"), 20)
                now = time.monotonic()
                if answer is None:
                    worst = max(worst, now - last)
                    out["stopped"] = True
                    break
                worst, last = max(worst, now - last), now
                time.sleep(0.1)
            out["longest_silence_s"] = round(worst, 2)
            send = tx.submit("send", peer=rx.key, tag=2, size=1000, seed=2)
            t1 = time.monotonic()
            res = rx.answer_within(
                rx.submit("recv", peer=tx.key, tag=2, size=1000, deadline=20, seed=2), 40
            )
            out["message_after"] = bool(res and res.get("ok") and res.get("verified"))
            out["message_s"] = round(time.monotonic() - t1, 2)
            s.close()
        elif scenario == "mutual":
            # Two transports linking to each other at once, three rounds.
            a_at, b_at = address, tx.ok("start")["address"]
            rounds = []
            for n in range(3):
                ca = rx.submit("connect", peer=tx.key, address=b_at, deadline=10.0)
                cb = tx.submit("connect", peer=rx.key, address=a_at, deadline=10.0)
                ra, rb = rx.answer_within(ca, 60), tx.answer_within(cb, 60)
                alive = rx.proc.poll() is None and tx.proc.poll() is None
                rounds.append(bool(ra and ra["ok"] and rb and rb["ok"]) if alive else "died")
                if not alive:
                    break
                for c, other in ((rx, tx), (tx, rx)):
                    c.answer_within(c.submit("remove_peer", peer=other.key), 20)
            out["rounds"] = rounds
        elif scenario == "stalled":
            # tx linked to rx; then tx dials a listener stopped (SIGSTOP) just after it
            # handed out its port: rx2's port, taken by a stranger, relayed by a fake.
            import os, signal
            from kvxferd.backends.mpi import wire
            link_carries_a_message(tx, rx, address, tag=1)
            rx2 = Child("gen2")
            try:
                h2, p2 = rx2.ok("start")["address"].rsplit(":", 1)
                g = hello(h2, int(p2), b"ghost/1")
                g.settimeout(30)
                data = b""
                while True:  # the rest of the ACK: key, port, nonce
                    data += g.recv(4096)
                    fields, pos = [], 0  # hello() read the frame's head
                    while pos + 2 <= len(data):
                        (n,) = struct.unpack("!H", data[pos:pos + 2])
                        if pos + 2 + n > len(data):
                            break
                        fields.append(data[pos + 2:pos + 2 + n])
                        pos += 2 + n
                    if len(fields) == 3:
                        break
                port2 = fields[1]
                os.kill(rx2.proc.pid, signal.SIGSTOP)
                srv = socket.socket()
                srv.bind(("127.0.0.1", 0))
                srv.listen(1)

                def fake():
                    c, _ = srv.accept()
                    c.recv(4096)
                    c.sendall(wire.frame(wire.ACK, rx2.key.encode(), port2, b"n" * 16))
                    time.sleep(120)

                threading.Thread(target=fake, daemon=True).start()
                t0 = time.monotonic()
                fake_at = "127.0.0.1:%d" % srv.getsockname()[1]
                conn = tx.submit("connect", peer=rx2.key, address=fake_at)
                time.sleep(0.3)
                send = tx.submit("send", peer=rx.key, tag=2, size=1000, seed=2)
                recv = rx.submit("recv", peer=tx.key, tag=2, size=1000, deadline=60, seed=2)
                worst, last, got = 0.0, time.monotonic(), None
                while got is None and time.monotonic() - t0 < 70:
                    answer = tx.answer_within(tx.submit("info"), 20)
                    now = time.monotonic()
                    worst, last = max(worst, now - last), now
                    got = rx.answer_within(recv, 0.1)
                out["message_s"] = None if got is None else round(time.monotonic() - t0, 1)
                out["longest_silence_s"] = round(worst, 1)
                res = tx.answer_within(conn, 60)
                out["connect_failed_s"] = round(time.monotonic() - t0, 1) if res else None
            finally:
                os.kill(rx2.proc.pid, signal.SIGCONT)
                rx2.stop()
        else:
            stop = time.monotonic() + seconds
            served = [0]

            def ghost(i):
                while time.monotonic() < stop:
                    try:
                        hello(host, int(port), b"ghost/%d" % i).close()
                        served[0] += 1
                    except (OSError, AssertionError):
                        time.sleep(0.01)

            threads = [threading.Thread(target=ghost, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            peak_a = peak_r = 0
            while time.monotonic() < stop:
                info = rx.ok("info")
                releasing = releasers()
                peak_a = max(peak_a, info["accepting"])
                peak_r = max(peak_r, releasing)
                time.sleep(0.05)
            for t in threads:
                t.join(60)
            out.update(peak_accepts=peak_a, peak_releasing=peak_r, served=served[0])
            out["alive"] = rx.proc.poll() is None
    finally:
        tx.stop()
        rx.stop()
    print("RESULT " + json.dumps(out), flush=True)
    """
)


def run(tree: Path, scenario: str, seconds: float) -> dict[str, object]:
    py = REPO / ".venv" / "bin" / "python"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [str(py), "-c", PROBE, scenario, str(seconds)],
        cwd=tree, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    return {"error": (proc.stderr or proc.stdout)[-400:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, help="another checkout, run beside this one")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--scenarios", nargs="+", default=["silent", "loop", "stalled", "mutual"])
    args = ap.parse_args()
    trees = [("this", REPO)] + ([("base", args.base.resolve())] if args.base else [])
    for n in range(args.passes):
        for scenario in args.scenarios:
            for name, tree in trees:
                res = run(tree, scenario, args.seconds)
                print(f"pass {n + 1} {scenario:6} {name:4} {json.dumps(res)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

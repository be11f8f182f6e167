"""An event loop that stops waking (a blocking call on the loop, a native call holding
the GIL, a stopped process) is counted and logged when it ends, and in a daemon's own
process a watcher logs, while it lasts, where the loop's thread is: what held the loop is
then in the log, not only the peers' "lost" that followed. A daemon stopped (SIGSTOP)
and resumed lives on: faulthandler's timer, tried first, crashed such daemons when its
dump raced the resumed thread."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

from ops_harness import http_get, parse, scrape, value

from kvxferd.service.loopmon import STALL_S
from kvxferd.sim.cluster import LocalCluster

# The runner's loop (uvloop, faulthandler) with a monitor, and a call that blocks it.
STALLED = textwrap.dedent(
    """
    import asyncio, logging, sys, time
    from kvxferd.service.loopmon import STALL_S, LoopMonitor
    from kvxferd.service.runner import run_event_loop

    def hold_the_loop() -> None:
        time.sleep(STALL_S + 1.0)

    async def main() -> int:
        monitor = LoopMonitor(interval_s=0.05)
        task = asyncio.ensure_future(monitor.run())
        while monitor.ticks < 2:
            await asyncio.sleep(0.01)
        hold_the_loop()
        ticks = monitor.ticks
        while monitor.ticks == ticks:
            await asyncio.sleep(0.01)
        task.cancel()
        print("STALLS", monitor.stalls, flush=True)
        return 0

    logging.basicConfig(level=logging.WARNING)
    sys.exit(run_event_loop(main))
    """
)


def test_a_blocked_loop_is_logged_with_where_it_is_blocked() -> None:
    done = subprocess.run(
        [sys.executable, "-c", STALLED], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "STALLS 1" in done.stdout, (done.stdout, done.stderr)
    # The watcher's word, while the loop was held: the blocking call is in its stack.
    held = done.stderr.split("the event loop has not run for", 1)
    assert len(held) == 2 and "in hold_the_loop" in held[1], done.stderr
    assert "the event loop stalled for" in held[1], done.stderr


def test_a_stopped_daemon_counts_the_stall(cluster: LocalCluster) -> None:
    d = cluster.start_daemon("gen", "generation")
    cluster.wait_ready(d)
    assert value(parse(scrape(d)), "kvxferd_event_loop_stalls_total") == 0
    d.kill(signal.SIGSTOP)
    try:
        time.sleep(STALL_S + 1.0)  # the stall itself: no deadline to wait for
    finally:
        d.kill(signal.SIGCONT)

    def stalls() -> int:
        code, _, body = http_get(d, "/v1/status")
        assert code == 200, body
        return int(json.loads(body)["event_loop"]["stalls"])

    # Counted when the monitor next wakes, which an answer may precede.
    give_up = time.monotonic() + 10
    while stalls() == 0:
        assert time.monotonic() < give_up, "the stall was never counted"
        time.sleep(0.05)
    assert stalls() == 1
    assert value(parse(scrape(d)), "kvxferd_event_loop_stalls_total") == 1
    assert "the event loop stalled for" in d.log_text()
    assert d.alive()

"""The operator's fence (FenceWriter, `kvxferd fence`) on one host, with real daemons.

On one host the generation daemon watches a context daemon's process: its exit fences
its holds by itself, and a stopped process (which still writes once resumed) must not
be fenced by anyone's word. tests/cluster/test_operator_fence.py covers the case the
fence is for: a writer on another host that died and never came back.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest
from daemon_harness import opened, status, wait_for

from kvxferd.client import CallError, Client
from kvxferd.commands.status_cmd import summary
from kvxferd.sim.cluster import DaemonProc, LocalCluster


def _cli_fence(d: DaemonProc, *args: str) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvxferd.cli", "fence", "--config", str(d.config_path), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _fence(d: DaemonProc, peer: str) -> int:
    with Client(d.api_socket, engine="operator") as client:
        return client.fence_writer(peer)


def _code(d: DaemonProc, peer: str) -> str:
    with pytest.raises(CallError) as info:
        _fence(d, peer)
    return str(info.value)  # "code: message"


def test_a_stopped_writer_on_this_host_is_refused_and_its_exit_fences(
    cluster: LocalCluster,
) -> None:
    timeouts = {"kv_transfer_timeout_ms": 30000}
    ctx = cluster.start_daemon("ctx", "context", transceiver=timeouts)
    gen = cluster.start_daemon("gen", "generation", transceiver=timeouts)

    assert _code(gen, "ctx").startswith("nothing_held"), "nothing waits for ctx yet"
    assert _code(gen, "not a name!").startswith("bad_request")
    assert _code(ctx, "gen").startswith("wrong_role")

    async def scenario() -> None:
        async with opened(gen, num_blocks=16) as g:
            # The receive asks ctx (its RequestData reaches ctx), then ctx stops before its
            # engine sends: the receive fails once the heartbeat is lost, and its blocks
            # stay held, since a stopped ctx may still write.
            await g.recv("r1", 100, ctx.peer_address)
            wait_for(lambda: status(ctx)["sessions"]["send"], 20, "ctx has the receive")
            ctx.proc.send_signal(signal.SIGSTOP)
            try:
                outcome = await g.client.wait("r1", timeout_s=60)
                assert outcome.status == "failed" and outcome.blocks_held, outcome
                assert status(gen)["holds"]["by_peer"]["ctx"]["holds"] == 1
                # What `kvxferd status` tells the operator (the heartbeat closed it).
                assert "ctx: 1 hold(s)" in summary(status(gen))
                assert "(not connected; gone for good? kvxferd fence ctx)" in summary(status(gen))

                # Its process is watched here and has not exited: nobody's word fences it.
                code, text = await asyncio.to_thread(_cli_fence, gen, "ctx")
                assert code == 1 and "writer_alive" in text and "has not exited" in text, text
                assert status(gen)["holds"]["requests"] == 1
            finally:
                ctx.proc.send_signal(signal.SIGKILL)
            ctx.proc.wait(10)
            # Its exit fences the hold by itself.
            released = await g.client.wait_released("r1", 30)
            assert released.how == "peer_exited", released
            await g.client.release("r1")

    asyncio.run(scenario())
    code, text = _cli_fence(gen, "ctx")
    assert code == 1 and "nothing_held" in text and "no hold waits for ctx" in text, text
    assert status(gen)["holds"]["released"] == {"peer_exited": 1}

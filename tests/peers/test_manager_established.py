"""PeerManager.on_established: called once a connection is registered, with the Info this
side sent in that connection's handshake, so a daemon can announce what changed while the
handshake ran (a pool registered then was in neither that Info nor a broadcast)."""

from __future__ import annotations

import asyncio

from manager_harness import quiet_manager

from kvxferd.backends.twosided import NoOneSidedBackend
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.handshake import Identity
from kvxferd.peers.manager import PeerManager
from kvxferd.peers.messages import Info, PoolInfo
from kvxferd.transceiver.dataplane import DataPlane

SECRET = b"test-secret"


def _info(name: str, pools: list[PoolInfo]) -> Info:
    return Info(
        agent_name=name,
        agent_metadata=b"",
        pools=list(pools),
        fingerprint="same",
        compat={},
        transceiver={},
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        context_parallel_size=1,
    )


def test_on_established_gets_the_info_sent_in_that_handshake() -> None:
    async def scenario() -> None:
        pools: list[PoolInfo] = []
        seen: list[tuple[str, list[PoolInfo], bool]] = []

        def manager(name: str, role: str) -> tuple[PeerManager, DataPlane]:
            dp = DataPlane(lambda: NoOneSidedBackend("none", name))

            async def make_info() -> Info:
                info = _info(name, pools if role == "context" else [])
                if role == "context":
                    # The engine registers a pool right after this Info was made.
                    pools.append(PoolInfo("pool0", {}, 0, 4096))
                return info

            m = quiet_manager(Identity(name, f"{name}-1", role, SECRET), dp, make_info, 5.0)

            async def established(conn: PeerConnection, sent: Info) -> None:
                seen.append((name, sent.pools, m.connections.get(conn.key) is conn))

            m.on_established = established
            return m, dp

        ctx, ctx_dp = manager("ctx", "context")
        gen, gen_dp = manager("gen", "generation")
        await ctx_dp.start()
        await gen_dp.start()
        try:
            address = await ctx.listen("127.0.0.1", 0)
            conn = await gen.connect(address)
            assert conn.info.pools == []  # what the context side sent: no pool yet
            for _ in range(500):  # the server side registers the connection after replying
                if len(seen) == 2:
                    break
                await asyncio.sleep(0.01)
            by_side = {name: (sent, registered) for name, sent, registered in seen}
            # Each side is told what it sent, with the connection already registered.
            assert by_side["ctx"] == ([], True)
            assert by_side["gen"] == ([], True)
            assert pools != []  # ...while the context side's pools have changed since
        finally:
            await gen.close()
            await ctx.close()
            await gen_dp.close()
            await ctx_dp.close()

    asyncio.run(scenario())

"""A shared dial whose every waiter gave up (each receive cancelled by its engine) and
that then failed leaves no "Task exception was never retrieved" ERROR, with its traceback,
in the daemon's log (seen in a 1->2 demo whose context daemon was stopped for 8 s); the
failure still counts in the dial backoff."""

from __future__ import annotations

import asyncio
import gc
import socket
from typing import Any

from manager_harness import quiet_manager

from kvxferd.backends.twosided import NoOneSidedBackend
from kvxferd.peers.handshake import Identity
from kvxferd.peers.messages import Info
from kvxferd.transceiver.dataplane import DataPlane


def test_a_failed_dial_nobody_waits_for_any_more_logs_no_unretrieved_error() -> None:
    async def scenario() -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        errors: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: errors.append(context))

        async def make_info() -> Info:
            raise AssertionError("no handshake gets this far")

        dp = DataPlane(lambda: NoOneSidedBackend("none", "gen"))
        m = quiet_manager(Identity("gen", "gen-1", "generation", b"secret"), dp, make_info, 0.2)
        await dp.start()
        # A peer that accepts the connection and never answers (a stopped daemon).
        silent = socket.create_server(("127.0.0.1", 0))
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        try:
            waiter = asyncio.ensure_future(m.connect(address))
            await asyncio.sleep(0.05)
            waiter.cancel()  # its receive was cancelled: nobody waits for the dial now
            for _ in range(200):
                if address not in m._dialing:
                    break
                await asyncio.sleep(0.02)
            assert address not in m._dialing, "the dial never ended"
            del waiter
            gc.collect()  # an unretrieved task error is reported when the task goes
            await asyncio.sleep(0)
            assert m.dial_backoff.status(), "the failed dial was not counted"
        finally:
            silent.close()
            await m.close()
            await dp.close()
        return errors

    errors = asyncio.run(scenario())
    assert not [e for e in errors if "never retrieved" in str(e.get("message"))], errors

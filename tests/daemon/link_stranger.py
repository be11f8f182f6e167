"""A client of a daemon's UCX or MPI listener that never authenticated over the peer
channel: it names a daemon key (its own or another's), proves no key or the one given
(hex), and trusts whatever the listener proves (so that the listener, not this client, is
what refuses). Prints LINKED, or REFUSED and the error.

    python link_stranger.py ucx|mpi NAME INCARNATION PEER_KEY ADDRESS [KEY_HEX]
"""

from __future__ import annotations

import asyncio
import sys

from kvxferd.backends.link_proof import Proofs


async def main(
    kind: str, name: str, incarnation: str, peer_key: str, address: str, key_hex: str = ""
) -> None:
    Proofs.proves = lambda self, proof, peer, me: True  # type: ignore[method-assign]
    if kind == "ucx":
        from kvxferd.backends.ucx import UcxTransport as Transport
    else:
        from kvxferd.backends.mpi import MpiTransport as Transport
    t = Transport(name, incarnation, secret=bytes.fromhex(key_hex))
    await t.start("127.0.0.1")
    try:
        await t.connect(peer_key, address, 20.0)
        print("LINKED", flush=True)
    except Exception as exc:  # what the listener's refusal looks like from here
        print("REFUSED", type(exc).__name__, exc, flush=True)
    finally:
        await t.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:7]))

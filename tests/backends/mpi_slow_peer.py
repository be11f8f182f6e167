"""A peer of an MPI rendezvous listener that takes the ACK and runs MPI_Comm_connect
`delay` seconds later (a peer held up between the two), then leaves. Prints what its
connect did.

    python mpi_slow_peer.py HOST PORT DELAY_S
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from kvxferd.backends.mpi import wire
from kvxferd.backends.mpi.bootstrap import init_runtime


async def main(host: str, port: int, delay_s: float) -> None:
    rt = init_runtime()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(wire.frame(wire.HELLO, b"slow/1", b"nonce of 16 byte"))
    await writer.drain()
    _, mpi_port, _ = await wire.read_frame(reader, wire.ACK, ("key", "port", "nonce"))
    print("ACK", flush=True)
    await asyncio.sleep(delay_s)
    t0 = time.monotonic()
    try:
        await asyncio.to_thread(rt.MPI.COMM_SELF.Connect, mpi_port.decode())
        print(f"CONNECTED after {time.monotonic() - t0:.2f} s", flush=True)
    except Exception as exc:
        print(
            f"FAILED after {time.monotonic() - t0:.2f} s: {str(exc).splitlines()[-1]}", flush=True
        )
    writer.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
    os._exit(0)  # MPI is never finalised (bootstrap.py)

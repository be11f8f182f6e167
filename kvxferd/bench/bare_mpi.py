"""The bare MPI transport (`mpi-cpp`'s own baseline).

Set-up is the daemons': kvxferd.backends.mpi.MpiTransport in both processes, started
without mpiexec (each bootstraps its own MPI: bootstrap.py, MPICH with the ucx netmod and
UCX_TLS=^cma unless set), linked by its TCP rendezvous and MPI_Comm_connect/accept
(link.py). The bytes then cross as MPI alone would move them: each round ONE MPI message
on that intercommunicator, sent from the sender's buffer and received straight into the
receiver's, both sides testing their request continuously (yielding to the event loop
between tests, as the adapter does while it spins). Done is the receiver's request
completing. Rounds as over any two-sided backend: the whole staging region.

What the adapter adds on top, and this pair leaves out on purpose (they are the staged
runtime's costs, issue 16): the header message before each payload, the receive into a
scratch buffer and its copy into the staging reservation, and the back-off to one test a
millisecond after a 2 s spin (under load a 1000 MiB round then takes minutes).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from kvxferd.backends.twosided import TwoSidedTransport
from kvxferd.bench import bare
from kvxferd.bench.bare import BareError
from kvxferd.bench.bare_links import TwoSidedLink
from kvxferd.transceiver.bounce import BounceRegion


class MpiBareLink:
    """TwoSidedLink for set-up; sends and receives on the link's intercommunicator."""

    one_sided = False

    def __init__(self) -> None:
        self._setup = TwoSidedLink(self._make)
        self._mpi: Any = None
        self._transport: Any = None
        self._region: BounceRegion | None = None

    def _make(self, name: str, incarnation: str) -> TwoSidedTransport:
        from kvxferd.backends.mpi import MpiTransport

        transport = MpiTransport(name, incarnation)
        self._transport = transport
        return transport

    async def listen(self, region: BounceRegion) -> dict[str, Any]:
        return await self._setup.listen(region)

    def accept(self, hello: dict[str, Any]) -> None:
        self._setup.accept(hello)

    async def settle(self, timeout_s: float) -> None:
        await self._setup.settle(timeout_s)

    async def attach(self, region: BounceRegion, info: dict[str, Any]) -> dict[str, Any]:
        self._region = region
        return await self._setup.attach(region, info)

    def _comm(self) -> tuple[Any, Any, int]:
        """(MPI, the live intercommunicator to the peer, its largest tag)."""
        # The adapter's own objects: the bare pair moves its bytes on the link it made.
        t = self._transport
        link = t._links.peer(self._setup.peer_key).live_link()
        if link is None or t._rt is None:
            raise BareError("the MPI link to the other side of the bare pair is gone")
        return t._rt.MPI, link.comm, int(link.tag_ub)

    @staticmethod
    async def _spin(req: Any) -> None:
        while not req.Test():
            await asyncio.sleep(0)

    async def receive(self, tag: int, out: memoryview) -> None:
        mpi, comm, tag_ub = self._comm()
        # Tags 1..: the transport itself sends nothing here, so no data tag of its own
        # can collide; tag 0 carries its headers.
        data_tag = tag % tag_ub + 1 if tag >= tag_ub else tag
        status = mpi.Status()
        req = comm.Irecv([out, out.nbytes, mpi.BYTE], 0, data_tag)
        while not req.Test(status):
            await asyncio.sleep(0)
        if status.Get_count(mpi.BYTE) != out.nbytes:
            raise BareError(f"round {tag}: received {status.Get_count(mpi.BYTE)} bytes")

    async def send(self, tag: int, nbytes: int) -> None:
        assert self._region is not None
        mpi, comm, tag_ub = self._comm()
        data_tag = tag % tag_ub + 1 if tag >= tag_ub else tag
        data = self._region.array[:nbytes]
        await self._spin(comm.Isend([data, nbytes, mpi.BYTE], 0, data_tag))

    async def close(self) -> None:
        await self._setup.close()


def link() -> MpiBareLink:
    return MpiBareLink()


if __name__ == "__main__":
    sys.exit(bare.main(link, "MPI"))

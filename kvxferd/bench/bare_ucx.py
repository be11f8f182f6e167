"""The bare UCX transport (`ucx-cpp`'s own baseline).

Each round ONE tagged message from the sender's buffer to the receiver's, through
kvxferd.backends.ucx.UcxTransport, the daemons' adapter: ucxx's asyncio API with the
daemons' progress mode and endpoint error handling on (so UCX picks TCP, as it does for the
daemons), on a uvloop event loop (kvxferd.bench.bare has the protocol). Done is the
receiver's `recv` returning. Rounds as over any two-sided backend: the whole staging region,
so an 8000-token request of the default geometry is one 1000 MiB message.

benchmarks/ucx_raw.py is the earlier standalone experiment (ucxx directly, fixed 64 MiB
messages) that chose the progress mode.
"""

from __future__ import annotations

import sys

from kvxferd.backends.twosided import TwoSidedTransport
from kvxferd.bench import bare
from kvxferd.bench.bare_links import TwoSidedLink


def link() -> TwoSidedLink:
    def make(name: str, incarnation: str) -> TwoSidedTransport:
        from kvxferd.backends.ucx import UcxTransport

        return UcxTransport(name, incarnation)

    return TwoSidedLink(make)


if __name__ == "__main__":
    sys.exit(bare.main(link, "UCX"))

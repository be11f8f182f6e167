"""The bare NIXL transport of the staged runtime (`nixl-cpp`'s own baseline).

Each round one contiguous NIXL write (one descriptor) from the sender's staging-sized buffer
into the receiver's registered buffer, through kvxferd.backends.nixl.NixlBackend, the
daemons' adapter with their agent settings, polled to DONE as they poll (kvxferd.bench.bare has
the protocol). Rounds as the staged runtime cuts them over a one-sided backend: at most
half the staging region (512 MiB at the default geometry, so an 8000-token request moves
as 128 + 122 blocks). The PYTHON runtime's baseline stays kvxferd.bench.raw (the request's
own segments, straight between the pools).
"""

from __future__ import annotations

import sys

from kvxferd.backends.base import Backend
from kvxferd.bench import bare
from kvxferd.bench.bare_links import OneSidedLink


def link() -> OneSidedLink:
    def make(agent_name: str) -> Backend:
        from kvxferd.backends.nixl import NixlBackend

        return NixlBackend(agent_name)

    return OneSidedLink(make)


if __name__ == "__main__":
    sys.exit(bare.main(link, "NIXL"))

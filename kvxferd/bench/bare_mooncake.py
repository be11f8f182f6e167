"""The bare Mooncake transport (`mooncake-cpp`'s own baseline).

Each round one contiguous write (one `transfer_submit_write`) of Mooncake's transfer engine
over TCP with P2PHANDSHAKE metadata, from the sender's buffer into the receiver's
registered one, through kvxferd.backends.mooncake.MooncakeBackend, the daemons' adapter
(same engine settings, the acknowledged TCP protocol, so DONE means applied at the
receiver), polled with `transfer_check_status` on the daemons' schedule
(kvxferd.bench.bare has the protocol). Rounds as over any one-sided backend: at most
half the staging region.
"""

from __future__ import annotations

import sys

from kvxferd.backends.base import Backend
from kvxferd.bench import bare
from kvxferd.bench.bare_links import OneSidedLink

#: The bench configurations' kv_transfer_timeout_ms (kvxferd.bench.configs).
_TIMEOUT_MS = 60000


def link() -> OneSidedLink:
    def make(agent_name: str) -> Backend:
        from kvxferd.backends.mooncake import MooncakeBackend

        return MooncakeBackend(agent_name, "127.0.0.1", _TIMEOUT_MS)

    return OneSidedLink(make)


if __name__ == "__main__":
    sys.exit(bare.main(link, "MOONCAKE"))

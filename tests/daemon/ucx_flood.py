"""A stranger that opens COUNT endpoints to a daemon's UCX listener and never says a word:
prints HELD and how many it opened, then holds them until its stdin closes.

    python ucx_flood.py ADDRESS COUNT
"""

from __future__ import annotations

import asyncio
import sys


async def main(address: str, count: int) -> None:
    import ucxx

    host, port = address.rsplit(":", 1)
    held = []
    for _ in range(count):
        try:
            held.append(
                await asyncio.wait_for(
                    ucxx.create_endpoint(host, int(port), endpoint_error_handling=True), 10
                )
            )
        except Exception as exc:  # a listener that closes at once may also refuse
            print("REFUSED", type(exc).__name__, exc, flush=True)
    print("HELD", len(held), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for ep in held:
        ep.abort()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))

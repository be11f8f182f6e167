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

    async def one() -> object:
        ep = ucxx.create_endpoint(host, int(port), endpoint_error_handling=True)
        return await asyncio.wait_for(ep, 10)

    held = []
    for start in range(0, count, 50):  # 50 at a time: all well within the 10 s hellos
        for got in await asyncio.gather(
            *(one() for _ in range(min(50, count - start))), return_exceptions=True
        ):
            if isinstance(got, BaseException):  # a listener that closes at once may refuse
                print("REFUSED", type(got).__name__, got, flush=True)
            else:
                held.append(got)
    print("HELD", len(held), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for ep in held:
        ep.abort()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))

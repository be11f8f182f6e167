"""What the staged runtime needs from a two-sided transport (UCX, MPI).

Two-sided backends move each round as a tagged message between the two
daemons' staging buffers; they have no one-sided memory registration, so the
daemon's data plane then runs `NoOneSidedBackend`, whose registration and
agent calls are no-ops.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from kvxferd.backends.base import HOST, Memory, Segments, XferHandle, XferStatus, host_only
from kvxferd.backends.link_secrets import LinkSecrets
from kvxferd.errors import PeerLostError, StartupError, TransferError, TransferTimeoutError


class TwoSidedTransport(Protocol):
    name: str
    # True: the sending daemon links to a peer right after the peer handshake rather
    # than at its first round (MPI: set-up overlapping transfers can crash MPICH).
    link_ahead: bool
    # What each new link proves (link_secrets.py); the daemon hands it the secrets its
    # peers send in their Info.
    link_secrets: LinkSecrets

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str: ...

    async def connect(self, peer_key: str, address: str, timeout_s: float) -> None: ...

    async def send(self, peer_key: str, tag: int, data: memoryview) -> None: ...

    async def recv(self, peer_key: str, tag: int, out: memoryview, timeout_s: float | None) -> int:
        """Receive the message `tag` from the peer into `out`; returns its size.

        `timeout_s` None: no bound (kv_transfer_timeout_ms null). On expiry
        TransferTimeoutError, and nothing can land in `out` afterwards. Any other
        failure leaves `out` alone too, unless `lent_until(error)` says how long the
        transport may still write there.
        """
        ...

    async def remove_peer(self, peer_key: str) -> None: ...

    def stalled_peers(self) -> dict[str, float]:
        """Peers alive whose messages have stopped arriving: peer key -> seconds since the
        last (MPI: kvxferd/backends/mpi/keepalive.py). The daemon is not ready while any is."""
        ...

    def listener_refused(self) -> dict[str, int]:
        """Connections to the transport's own listener closed before their hellos, by
        reason (preauth_limit, preauth_per_source_limit: kvxferd/peers/preauth.py)."""
        ...

    async def close(self) -> None: ...


def connect_timeout(
    transport: str, peer_key: str, address: str, awaited: str, timeout_s: float
) -> TransferTimeoutError:
    """A connect to a peer that got no `awaited` (answer, hello answer...) in time."""
    return TransferTimeoutError(
        f"{transport} connect to {peer_key} at {address}: no {awaited} within {timeout_s:g}s"
    )


@contextlib.contextmanager
def connect_failures(
    transport: str,
    peer_key: str,
    address: str,
    timeout_s: float,
    lost: type[Exception] = OSError,
    why: Callable[[Exception], str] = str,
) -> Iterator[None]:
    """Around a transport's first contact with a peer: no answer within `timeout_s` is a
    TransferTimeoutError, a `lost` exception (`why` says what it was) a PeerLostError."""
    try:
        yield
    except (asyncio.TimeoutError, TimeoutError) as exc:
        raise connect_timeout(transport, peer_key, address, "answer", timeout_s) from exc
    except lost as exc:
        raise PeerLostError(
            f"{transport} connect to {peer_key} at {address} failed ({why(exc)}); "
            f"is the peer running?{_devices_hint(os.environ)}"
        ) from exc


def _devices_hint(env: Mapping[str, str]) -> str:
    """A hint for an operator who limited UCX to some devices: an address none of them
    reaches (loopback with UCX_NET_DEVICES naming a NIC, seen) fails as unreachable."""
    devices = env.get("UCX_NET_DEVICES", "").strip()
    if not devices or devices.lower() == "all":
        return ""
    return f" (UCX_NET_DEVICES={devices} here: UCX reaches only addresses on those devices)"


def lent_until(exc: BaseException) -> asyncio.Future[Any] | None:
    """For a recv that failed after its payload began landing in `out` (MPI): a future
    done once the transport can no longer write there (it may never be); None when
    nothing can land in `out` any more."""
    fut = getattr(exc, "out_lent_until", None)
    return fut if isinstance(fut, asyncio.Future) and not fut.done() else None


def round_tag(rx_token: int, first_block: int) -> int:
    """The tag of one staged round: unique per receive (rx_token) and round."""
    return (rx_token * 1_000_003 + first_block) & ((1 << 63) - 1)


class NoOneSidedBackend:
    """The data plane of a daemon whose bytes cross through a two-sided transport."""

    def __init__(self, name: str, agent_name: str) -> None:
        self.name = name
        self.agent_name = agent_name

    def register(self, address: int, nbytes: int, memory: Memory = HOST) -> object:
        # Nothing to register for host memory, but UCX and MPI send staging bytes as host
        # buffers here: a device region would be sent as if it were host memory.
        refused = host_only(self.name, memory)
        if refused is not None:
            raise StartupError(refused)
        return None

    def deregister(self, registration: object) -> None:
        return None

    def metadata(self) -> bytes:
        return b""

    def add_peer(self, metadata: bytes) -> str:
        return ""

    def remove_peer(self, agent_name: str) -> None:
        return None

    def connect(self, agent_name: str) -> None:
        return None

    def post_write(
        self,
        local: Segments,
        remote: Segments,
        agent_name: str,
        notif: bytes = b"",
        *,
        local_memory: Memory = HOST,
        remote_memory: Memory = HOST,
        remote_regions: Sequence[tuple[int, int]] = (),
    ) -> tuple[XferHandle, XferStatus]:
        raise TransferError(
            host_only(self.name, local_memory, remote_memory)
            or f"backend {self.name} has no one-sided writes"
        )

    def poll(self, handle: XferHandle) -> XferStatus:
        return XferStatus.ERROR

    def release(self, handle: XferHandle) -> None:
        handle.released = True

    def close(self) -> None:
        return None

"""A small typed client for the part of etcd's v3 API discovery uses, over gRPC.

It uses aetcd's generated etcd API (aetcd.rpc: the protobuf messages and stubs) on
channels it makes itself, because aetcd's own Client opens plaintext channels only and
one endpoint: here a channel is TLS when daemon.etcd.ca_file is set, the endpoints are
tried in turn, and every call has a deadline. aetcd is the optional extra `etcd`; it is
imported only when etcd discovery is configured.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvxferd.errors import KvxferdError, StartupError

log = logging.getLogger("kvxferd.discovery")

# gRPC pings a quiet connection so that a silent etcd (a partition, not a closed socket)
# is noticed within seconds rather than at the next call.
_CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 3000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


class EtcdError(KvxferdError):
    """An etcd call failed (unreachable, timed out, refused); the text says which."""


def _rpc() -> Any:
    try:
        import aetcd.rpc as rpc
    except ImportError as exc:
        raise StartupError(
            "daemon.discovery is etcd, but the etcd client is not installed: "
            "pip install 'kvxferd[etcd]' (scripts/install.sh does)"
        ) from exc
    return rpc


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    lease: int
    create_revision: int
    mod_revision: int


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    kv: KeyValue


@dataclass(frozen=True)
class EtcdAccess:
    """How to reach etcd: endpoints (host, port), TLS material, credentials, deadline."""

    endpoints: list[tuple[str, int]]
    timeout_s: float
    tls: tuple[bytes, bytes | None, bytes | None] | None = None
    username: str | None = None
    password: str | None = None


def _kv(raw: Any) -> KeyValue:
    return KeyValue(
        raw.key.decode(errors="replace"),
        bytes(raw.value),
        int(raw.lease),
        int(raw.create_revision),
        int(raw.mod_revision),
    )


def _range_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's prefix range)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class EtcdClient:
    """One channel at a time to one of the endpoints; `rotate` moves to the next."""

    def __init__(self, access: EtcdAccess) -> None:
        self._rpc = _rpc()
        self.access = access
        self._index = 0
        self._channel: Any = None
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._kv: Any = None
        self._lease: Any = None
        self._watch: Any = None

    @property
    def endpoint(self) -> str:
        host, port = self.access.endpoints[self._index]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def connect(self) -> None:
        """Open a channel to the current endpoint (and authenticate, with credentials)."""
        if self._channel is not None:
            return
        rpc = self._rpc
        import grpc

        target = self.endpoint
        if self.access.tls is not None:
            ca, cert, key = self.access.tls
            creds = grpc.ssl_channel_credentials(ca, key, cert)
            channel = grpc.aio.secure_channel(target, creds, options=_CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self._channel = channel
        self._kv = rpc.KVStub(channel)
        self._lease = rpc.LeaseStub(channel)
        self._watch = rpc.WatchStub(channel)
        self._metadata = None
        if self.access.username is not None:
            auth = rpc.AuthStub(channel)
            request = rpc.AuthenticateRequest(
                name=self.access.username, password=self.access.password or ""
            )
            reply = await self._call(auth.Authenticate, request, "authenticate")
            self._metadata = (("token", reply.token),)

    async def rotate(self) -> None:
        """Drop the channel and move to the next endpoint (after a failure)."""
        await self.close()
        self._index = (self._index + 1) % len(self.access.endpoints)

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            try:
                await channel.close()
            except Exception as exc:  # a channel that fails to close is gone anyway
                log.debug("closing the etcd channel: %s", exc)

    async def _call(self, method: Any, request: Any, what: str) -> Any:
        import grpc

        try:
            return await method(request, timeout=self.access.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise EtcdError(
                f"etcd {what} at {self.endpoint}: {exc.code().name}: {exc.details()}"
            ) from None

    # ----------------------------------------------------------------- calls

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, and the store revision they were read at."""
        await self.connect()
        key = prefix.encode()
        request = self._rpc.RangeRequest(key=key, range_end=_range_end(key))
        reply = await self._call(self._kv.Range, request, "range")
        return [_kv(kv) for kv in reply.kvs], int(reply.header.revision)

    async def get(self, key: str) -> KeyValue | None:
        await self.connect()
        reply = await self._call(self._kv.Range, self._rpc.RangeRequest(key=key.encode()), "get")
        return _kv(reply.kvs[0]) if reply.kvs else None

    async def put_if_absent(self, key: str, value: bytes, lease: int) -> KeyValue | None:
        """Create `key` with `value` under `lease` in one transaction, unless it exists:
        None when created, else what holds it now."""
        await self.connect()
        rpc = self._rpc
        k = key.encode()
        compare = rpc.Compare(
            result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, key=k, create_revision=0
        )
        put = rpc.RequestOp(request_put=rpc.PutRequest(key=k, value=value, lease=lease))
        get = rpc.RequestOp(request_range=rpc.RangeRequest(key=k))
        request = rpc.TxnRequest(compare=[compare], success=[put], failure=[get])
        reply = await self._call(self._kv.Txn, request, "put-if-absent")
        if reply.succeeded:
            return None
        kvs = reply.responses[0].response_range.kvs
        # Gone between the compare and the read cannot happen inside one transaction; an
        # empty answer would be etcd's bug: report it as a holder nobody can name.
        return _kv(kvs[0]) if kvs else KeyValue(key, b"", 0, 0, 0)

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, granted TTL in seconds)."""
        await self.connect()
        reply = await self._call(
            self._lease.LeaseGrant, self._rpc.LeaseGrantRequest(TTL=ttl_s), "lease grant"
        )
        if reply.error:
            raise EtcdError(f"etcd lease grant at {self.endpoint}: {reply.error}")
        return int(reply.ID), int(reply.TTL)

    async def keepalive(self, lease: int) -> int:
        """Refresh `lease` once; the TTL it has again (0: the lease is gone)."""
        await self.connect()
        import grpc

        request = self._rpc.LeaseKeepAliveRequest(ID=lease)

        async def one() -> int:
            call = self._lease.LeaseKeepAlive(iter([request]), metadata=self._metadata)
            try:
                async for reply in call:
                    return int(reply.TTL)
                return 0
            finally:
                call.cancel()

        try:
            return await asyncio.wait_for(one(), self.access.timeout_s)
        except asyncio.TimeoutError:
            raise EtcdError(f"etcd lease keepalive at {self.endpoint}: timed out") from None
        except grpc.aio.AioRpcError as exc:
            raise EtcdError(
                f"etcd lease keepalive at {self.endpoint}: {exc.code().name}: {exc.details()}"
            ) from None

    async def time_to_live(self, lease: int) -> int:
        """Seconds `lease` has left (-1 or 0: gone)."""
        await self.connect()
        request = self._rpc.LeaseTimeToLiveRequest(ID=lease)
        reply = await self._call(self._lease.LeaseTimeToLive, request, "lease time-to-live")
        return int(reply.TTL)

    async def revoke(self, lease: int) -> None:
        await self.connect()
        request = self._rpc.LeaseRevokeRequest(ID=lease)
        await self._call(self._lease.LeaseRevoke, request, "lease revoke")

    async def watch_prefix(
        self, prefix: str, start_revision: int
    ) -> AsyncIterator[list[WatchEvent]]:
        """Batches of events under `prefix` from `start_revision` on, until the stream
        fails (EtcdError) or the caller stops iterating. A watch that etcd cancels (its
        start revision compacted away) raises too: the caller lists again."""
        await self.connect()
        import grpc

        rpc = self._rpc
        key = prefix.encode()
        create = rpc.WatchCreateRequest(
            key=key, range_end=_range_end(key), start_revision=start_revision
        )
        stop = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield rpc.WatchRequest(create_request=create)
            await stop.wait()  # the request side stays open as long as the watch

        call = self._watch.Watch(requests(), metadata=self._metadata)
        try:
            async for reply in call:
                if reply.canceled:
                    raise EtcdError(
                        f"etcd cancelled the watch at {self.endpoint}: "
                        f"{reply.cancel_reason or 'no reason given'}"
                        + (
                            f" (revision {start_revision} compacted; now {reply.compact_revision})"
                            if reply.compact_revision
                            else ""
                        )
                    )
                if reply.created and not reply.events:
                    continue
                yield [
                    WatchEvent("delete" if ev.type == rpc.Event.DELETE else "put", _kv(ev.kv))
                    for ev in reply.events
                ]
            raise EtcdError(f"etcd closed the watch stream at {self.endpoint}")
        except grpc.aio.AioRpcError as exc:
            raise EtcdError(
                f"etcd watch at {self.endpoint}: {exc.code().name}: {exc.details()}"
            ) from None
        finally:
            stop.set()
            call.cancel()

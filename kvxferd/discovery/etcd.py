"""etcd discovery: register under a lease, keep it alive, watch the prefix, survive etcd.

The life of one daemon's registration (docs/operations.md, "Discovery with etcd"):

* start: a lease of daemon.etcd.lease_ttl_s is granted and the key created in a
  put-if-absent transaction. A key already there under another incarnation is either a
  live daemon of the same name or this name's previous process, killed without a clean
  stop, whose lease has not ended yet: the daemon waits while that lease counts down,
  and refuses to start, naming the holder, once it sees the lease refreshed (alive).
  etcd unreachable at start is not fatal: the daemon serves with discovery down and
  registers when etcd comes.
* running: a keepalive every TTL / 3; the prefix listed, then watched from the list's
  revision + 1, into the members map (kvxferd.discovery.members).
* etcd lost: discovery is marked down (connections already made keep their own
  heartbeats; names resolve from the last member list), calls are retried with backoff
  on the next endpoint; when etcd answers again the lease and key are checked and made
  again if gone, the prefix listed and the watch created again.
* clean stop: the lease is revoked, so the key goes at once; a killed daemon's key goes
  when its lease ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass

from kvxferd.config.discovery import EtcdSection, advertised_address
from kvxferd.discovery.base import DiscoveryState, Resolution
from kvxferd.discovery.etcd_client import EtcdAccess, EtcdClient, EtcdError
from kvxferd.discovery.members import Members
from kvxferd.discovery.record import BadRegistration, Registration, decode, encode, key_of
from kvxferd.errors import StartupError

log = logging.getLogger("kvxferd.discovery")

_BACKOFF_FIRST_S = 0.2
_BACKOFF_MAX_S = 5.0
# After the holder's lease should have ended: etcd checks expiry about every 0.5 s.
_EXPIRY_SLACK_S = 1.0
_CONFLICT_POLL_S = 0.25


class NameTakenError(StartupError):
    """Another live daemon holds this daemon's name in etcd."""


@dataclass(frozen=True)
class Me:
    """What this daemon registers (its address is known once it listens)."""

    name: str
    role: str
    incarnation: str
    tp_rank: int
    tp_size: int
    version: str


def access_of(etcd: EtcdSection) -> EtcdAccess:
    return EtcdAccess(
        endpoints=etcd.endpoint_hostports(),
        timeout_s=etcd.connect_timeout_ms / 1e3,
        tls=etcd.read_tls(),
        username=etcd.username,
        password=etcd.read_password(),
    )


class EtcdDiscovery:
    def __init__(self, etcd: EtcdSection, me: Me, client: EtcdClient | None = None) -> None:
        self.cfg = etcd
        self.me = me
        self.client = client or EtcdClient(access_of(etcd))
        self.key = key_of(etcd.cluster, me.name)
        self.state = DiscoveryState("etcd", up=False, key=self.key)
        self.static_peers: dict[str, str] = {}
        self.members_map = Members(etcd.prefix, self.state)
        self._value = b""
        self._lease: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._revision = 0  # of the last list

    # ------------------------------------------------------------- lifecycle

    async def start(self, listen_address: str) -> None:
        address = advertised_address(self.cfg, listen_address)
        m = self.me
        self._value = encode(
            Registration(
                name=m.name,
                role=m.role,
                address=address,
                tp_rank=m.tp_rank,
                tp_size=m.tp_size,
                incarnation=m.incarnation,
                version=m.version,
            )
        )
        log.info(
            "discovery: etcd at %s, cluster %s, registering %s as %s (lease TTL %d s)",
            ", ".join(self.cfg.endpoints),
            self.cfg.cluster,
            self.key,
            address,
            self.cfg.lease_ttl_s,
        )
        try:
            await self._register()
            self._revision = await self._list()
        except EtcdError as exc:
            self._down(exc, "registration")
            log.warning(
                "discovery: etcd not reachable at start (%s): serving with discovery down; "
                "registering as soon as etcd answers",
                exc,
            )
            await self.client.rotate()
        self._task = asyncio.create_task(self._run(), name="discovery-etcd")

    async def close(self) -> None:
        """Revoke the lease (the key goes at once) and stop; idempotent."""
        if self._closing:
            return
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                await self.client.revoke(lease)
                log.info("discovery: lease revoked, %s removed", self.key)
            except EtcdError as exc:
                log.warning(
                    "discovery: could not revoke the lease (%s); %s goes when it ends, within %d s",
                    exc,
                    self.key,
                    self.cfg.lease_ttl_s,
                )
        self.state.registered = False
        self.state.mark(False, "stopped")
        await self.client.close()

    # ------------------------------------------------------------- resolving

    def resolve(self, name: str) -> Resolution:
        return self.members_map.resolve(name, self.cfg.cluster)

    def members(self) -> dict[str, str]:
        return {name: reg.address for name, reg in self.members_map.by_name.items()}

    # ---------------------------------------------------------- registration

    async def _register(self) -> None:
        """Make sure our key exists under a live lease of ours (creating either)."""
        if self._lease is not None and await self.client.time_to_live(self._lease) <= 0:
            log.warning("discovery: our lease ended while etcd was away; registering again")
            self._lease = None
        if self._lease is None:
            self.state.registered = False
            self._lease, granted = await self.client.grant(self.cfg.lease_ttl_s)
            if granted != self.cfg.lease_ttl_s:
                log.info(
                    "discovery: etcd granted a TTL of %d s (asked %d)",
                    granted,
                    self.cfg.lease_ttl_s,
                )
        deadline: float | None = None
        first_left, first_at = 0, 0.0  # the holder's TTL when first seen, and when
        refreshed = time.monotonic()
        while True:
            if deadline is not None and time.monotonic() - refreshed >= self.cfg.lease_ttl_s / 3:
                # Waiting out a holder can take a whole TTL, and our lease, granted before
                # the wait, gets no keepalive until we serve: refresh it, or it ends a few
                # seconds after we registered and deletes our key (seen: a restarted daemon
                # left discovery 3.5 s after registering; receives naming it were refused).
                refreshed = time.monotonic()
                if await self.client.keepalive(self._lease) <= 0:
                    self._lease, _ = await self.client.grant(self.cfg.lease_ttl_s)
            holder = await self.client.put_if_absent(self.key, self._value, self._lease)
            if holder is None or holder.lease == self._lease:
                break
            theirs = _describe(holder.key, holder.value, self.cfg.prefix)
            if deadline is None:
                left = await self.client.time_to_live(holder.lease) if holder.lease else -1
                if holder.lease == 0:
                    raise NameTakenError(
                        f"daemon name {self.me.name!r} is held in etcd at {self.key} by a key "
                        f"without a lease ({theirs}), which never expires: remove it "
                        f"(etcdctl del {self.key}) or choose another daemon.name"
                    )
                wait_s = max(left, 0) + _EXPIRY_SLACK_S
                first_left, first_at = left, time.monotonic()
                deadline = first_at + wait_s
                log.warning(
                    "discovery: daemon name %s is held in etcd by %s; waiting up to %.1f s "
                    "for its lease to end (this name's previous process, killed without a "
                    "clean stop, leaves its key until then)",
                    self.me.name,
                    theirs,
                    wait_s,
                )
            if time.monotonic() >= deadline:
                if not await self._holder_refreshed(holder.lease, first_left, first_at):
                    # Still decaying (etcd reports whole seconds and expires leases on a
                    # 0.5 s tick): wait for the rest rather than refuse a dead holder.
                    left = await self.client.time_to_live(holder.lease)
                    deadline = time.monotonic() + max(left, 0) + _EXPIRY_SLACK_S
                    await asyncio.sleep(_CONFLICT_POLL_S)
                    continue
                self.state.count("conflict")
                raise NameTakenError(
                    f"daemon name {self.me.name!r} is taken: {self.key} is held by {theirs}, "
                    "whose lease is kept alive (another daemon runs under this name): stop "
                    "it, or give this daemon another daemon.name"
                )
            await asyncio.sleep(_CONFLICT_POLL_S)
        if not self.state.registered:
            log.info("discovery: registered %s (lease %x)", self.key, self._lease)
        self.state.registered = True

    async def _holder_refreshed(self, lease: int, first_left: int, first_at: float) -> bool:
        """Whether the holder's lease was kept alive since we first read its TTL: a live
        daemon refreshes it (its TTL goes back up), a killed one's only counts down."""
        left = await self.client.time_to_live(lease)
        if left <= 0:
            return False  # gone: its key goes with it
        decayed = first_left - (time.monotonic() - first_at)
        return left > decayed + 1.5  # whole seconds, rounded down, on both readings

    async def _list(self) -> int:
        kvs, revision = await self.client.get_prefix(self.cfg.prefix)
        self.members_map.replace(kvs)
        return revision

    # ---------------------------------------------------------------- running

    async def _run(self) -> None:
        backoff = _BACKOFF_FIRST_S
        fresh = self.state.registered  # start() just registered and listed
        while not self._closing:
            try:
                if not fresh:
                    await self._register()
                    self._revision = await self._list()
                fresh = False
                if self.state.mark(True):
                    log.info(
                        "discovery: up (etcd %s), %d member(s)",
                        self.client.endpoint,
                        self.state.members,
                    )
                backoff = _BACKOFF_FIRST_S
                await self._serve(self._revision)
            except asyncio.CancelledError:
                raise
            except NameTakenError as exc:
                # Not at start: the daemon serves; it keeps trying in case the holder goes.
                self._down(exc, "conflict", level=logging.ERROR)
            except EtcdError as exc:
                self._down(exc, "registration" if not self.state.registered else "watch")
                await self.client.rotate()
            except Exception as exc:  # never crash the daemon: discovery is a hint
                log.exception("discovery: unexpected error; retrying")
                self._down(exc, "internal")
                await self.client.rotate()
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _serve(self, revision: int) -> None:
        """Keepalive and watch together until one fails (its error is raised)."""
        tasks = [
            asyncio.create_task(self._keepalive(), name="discovery-keepalive"),
            asyncio.create_task(self._watch(revision + 1), name="discovery-watch"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises what ended it
            raise EtcdError("discovery: keepalive or watch ended")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _keepalive(self) -> None:
        interval = self.cfg.lease_ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            assert self._lease is not None
            try:
                ttl = await self.client.keepalive(self._lease)
            except EtcdError:
                self.state.count("keepalive")
                raise
            if ttl <= 0:
                self._lease = None
                self.state.registered = False
                self.state.count("keepalive")
                raise EtcdError("our lease ended (etcd expired it); registering again")

    async def _watch(self, start_revision: int) -> None:
        async for events in self.client.watch_prefix(self.cfg.prefix, start_revision):
            for event in events:
                if event.kind == "put":
                    self.members_map.put(event.kv)
                    continue
                self.members_map.delete(event.kv.key)
                if event.kv.key == self.key and not self._closing:
                    # Deleted by hand, or our lease ended: we are not findable; make it again.
                    self.state.registered = False
                    raise EtcdError(f"our key {self.key} was deleted; registering again")

    def _down(self, exc: BaseException, kind: str, level: int = logging.WARNING) -> None:
        self.state.count(kind)
        text = str(exc)[:500]
        changed = self.state.mark(False, text)
        if changed or level >= logging.ERROR:
            log.log(level, "discovery: down: %s", text)
        else:
            log.debug("discovery: still down: %s", text)


def _describe(key: str, value: bytes, prefix: str) -> str:
    """The holder of a key, for a refusal: its incarnation and address, when it decodes."""
    try:
        reg = decode(key, value, prefix)
    except BadRegistration as exc:
        return f"a value that is not a registration ({exc})"
    return f"incarnation {reg.incarnation} ({reg.role} at {reg.address}, version {reg.version})"

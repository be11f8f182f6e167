"""The members map etcd discovery keeps: who is registered, and who left and when."""

from __future__ import annotations

import logging
import time

from kvxferd.discovery.base import DiscoveryState, Resolution
from kvxferd.discovery.etcd_client import KeyValue
from kvxferd.discovery.record import BadRegistration, Registration, decode
from kvxferd.service.logs import LogLimiter

log = logging.getLogger("kvxferd.discovery")

# Names remembered after they left, to tell an engine "it left" rather than "never seen".
_VANISHED_KEPT = 1024


class Members:
    """Built from a list of the prefix, then kept by the watch's events. A value that does
    not decode is skipped (logged at most once a minute per key) and counted."""

    def __init__(self, prefix: str, state: DiscoveryState) -> None:
        self.prefix = prefix
        self.state = state
        self.by_name: dict[str, Registration] = {}
        self.vanished: dict[str, tuple[float, str]] = {}  # name -> (monotonic, incarnation)
        self._bad_log = LogLimiter(60.0, burst=1)

    def replace(self, kvs: list[KeyValue]) -> None:
        """A fresh list: who is not in it has left."""
        before = self.by_name
        self.by_name = {}
        for kv in kvs:
            self.put(kv, before)
        for name in set(before) - set(self.by_name):
            self.by_name[name] = before[name]  # for _left to report it
            self._left(name, "absent when discovery listed the prefix again")

    def put(
        self, kv: KeyValue, known: dict[str, Registration] | None = None
    ) -> Registration | None:
        """Take a put event (or a listed key); `known`: who was there before a re-list,
        so that only changes are logged."""
        try:
            reg = decode(kv.key, kv.value, self.prefix)
        except BadRegistration as exc:
            self.state.count("malformed")
            self._bad_log.log(
                log,
                logging.WARNING,
                kv.key,
                "discovery: ignoring %s (revision %d): %s",
                kv.key[:200],
                kv.mod_revision,
                exc,
            )
            # What the key held before is no longer there to trust either.
            name = kv.key[len(self.prefix) :]
            if name in self.by_name:
                self._left(name, "its value was replaced by one that does not decode")
            self.state.members = len(self.by_name)
            return None
        old = (self.by_name if known is None else known).get(reg.name)
        self.by_name[reg.name] = reg
        self.vanished.pop(reg.name, None)
        self.state.members = len(self.by_name)
        if old is None or old.incarnation != reg.incarnation or old.address != reg.address:
            log.info(
                "discovery: %s joined (%s at %s, incarnation %s, tp %d/%d, version %s)",
                reg.name,
                reg.role,
                reg.address,
                reg.incarnation,
                reg.tp_rank,
                reg.tp_size,
                reg.version,
            )
        return reg

    def delete(self, key: str) -> None:
        name = key[len(self.prefix) :]
        if name in self.by_name:
            self._left(name, "its key was deleted (lease ended or clean stop)")

    def _left(self, name: str, why: str) -> None:
        reg = self.by_name.pop(name)
        self.vanished[name] = (time.monotonic(), reg.incarnation)
        while len(self.vanished) > _VANISHED_KEPT:
            self.vanished.pop(next(iter(self.vanished)))
        self.state.members = len(self.by_name)
        log.info("discovery: %s left (incarnation %s): %s", name, reg.incarnation, why)

    def resolve(self, name: str, cluster: str) -> Resolution:
        reg = self.by_name.get(name)
        stale = ""
        if not self.state.up:
            since = time.strftime("%H:%M:%S", time.localtime(self.state.since))
            stale = (
                f" (discovery is down since {since}: "
                f"{self.state.last_error or 'etcd unreachable'}; the member list may be stale)"
            )
        if reg is not None:
            return Resolution(reg.address, f"registered, incarnation {reg.incarnation}{stale}")
        gone = self.vanished.get(name)
        if gone is not None:
            ago = time.monotonic() - gone[0]
            return Resolution(
                None,
                f"it left discovery {ago:.1f} s ago (incarnation {gone[1]}: its lease ended or "
                f"it stopped){stale}",
            )
        return Resolution(
            None, f"no daemon of this name is registered in cluster {cluster!r}{stale}"
        )

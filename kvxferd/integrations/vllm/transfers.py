"""The worker side of the vLLM connector: kvxferd calls, and exactly one completion each.

vLLM's scheduler crashes on a completion it does not expect (an id reported twice, or a
send reported before the request finished), and leaks the blocks of one it never gets. So
every planned transfer is an entry here until it is reported once:

* a receive: in `finished_recving` when its outcome is `done`; in `finished_recving` and
  `failed_recving` (the same step, as vLLM requires) when it failed, but only once no write
  can land in its blocks any more: a failure with `blocks_held` waits for the daemon's
  `released` event (fencing), however long that takes;
* a receive whose request vLLM finished (the client went away) while it is still posted:
  cancelled (again each step while the daemon says `busy`), then reported as above;
* a send: in `finished_sending` once its outcome arrived (whatever it says: the blocks are
  free again only then) and vLLM has named the request in some `finished_req_ids`.

A connection to the daemon that ended fails every entry without a `done` outcome, and the
daemon is dialed again, at most once a second, when there is work for it. A transfer whose
blocks the daemon may still write (a receive) or read (a send's drained write) - no
outcome yet, or one with `blocks_held` not released - fails only once the daemon's process
has exited, or, while it lives on, once it says on a new connection that it let go of the
old one (ConnectionState "gone": the old connection's requests ended and its pool is
deregistered). A process's end takes every write it brokered with it (its registrations,
its mappings), but a connection the daemon closed while it lives on (its shutdown's last
milliseconds, a frame it refused) is no proof by itself, and neither is a stopped process. Where the
daemon's process cannot be watched from here (another pid namespace, no pidfd, an
unreadable /proc, a daemon too old to say which process it is), the connection's end is
taken as its exit, as before, and said so.

Calls are started, not waited for (Client.start_recv / start_send): `post` runs in vLLM's
start_load_kv, before the step's forward pass, and a round trip to the daemon for each of
the step's transfers would hold the pass back by as many round trips. A call the daemon
refuses fails its entry in a later step's `collect`, as a failed transfer does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvxferd.client import CallError, Client, DaemonGoneError, Outcome
from kvxferd.integrations.vllm.orphans import LetGo
from kvxferd.integrations.vllm.plan import StepPlan
from kvxferd.peers.process import ProcessInfo, alive
from kvxferd.service.logs import TEXT_LIMIT, shown

log = logging.getLogger("kvxferd.vllm")

_REDIAL_EVERY_S = 1.0
# How long the step that starts a dial waits for it (a daemon that is up answers in
# milliseconds, a loaded host's in well under a second).
_DIAL_WAIT_S = 2.0
# The client's loop thread makes the step's started calls; it answers in well under a
# millisecond unless the process is starved.
_FLUSH_S = 10.0


@dataclass
class _Entry:
    transfer_id: str
    side: str  # "recv" or "send"
    failed: bool = False
    outcome: Outcome | None = None
    aborted: bool = False  # vLLM finished the request while its receive was posted
    seen_finished: bool = False  # the request was in a finished_req_ids (sends)
    released: bool = False  # the daemon forgot the request (Client.release)
    # The started call's outcome (start_recv / start_send): fails with the daemon's refusal.
    started: concurrent.futures.Future[Outcome] | None = None
    # The cancel asked of an aborted receive, until its answer ("busy": asked again).
    cancel: concurrent.futures.Future[str] | None = None
    cancel_answered: bool = False  # an outcome is on its way, or the cancel was refused
    # A transfer whose connection ended while its blocks might still be written or read:
    # failed once this daemon process has exited, or let go of the connection numbered
    # orphan_conn (Transfers._lost, orphans.LetGo).
    orphan_of: ProcessInfo | None = None
    orphan_conn: int = 0


@dataclass
class Results:
    sending: set[str]
    recving: set[str]
    failed: set[str]


def _settle(entry: _Entry) -> BaseException | None:
    """Take the outcome of the entry's started call once it arrived; what stopped the call
    instead, if it failed (never cancelled: nothing here cancels it)."""
    started = entry.started
    if entry.outcome is not None or started is None or not started.done():
        return None
    exc = started.exception()
    if exc is None:
        entry.outcome = started.result()
    return exc


def _may_be_touched(entry: _Entry, client: Client) -> bool:
    """A transfer whose blocks the daemon may still write (a receive) or read (a send's
    drained write): no outcome yet, or one that says they are held and no `released`
    came. A call the daemon refused (CallError) was never accepted."""
    if entry.failed or isinstance(_settle(entry), CallError):
        return False
    outcome = entry.outcome
    if outcome is None:
        return True
    return outcome.blocks_held and client.released(entry.transfer_id) is None


def _release_ended(req_id: str, done: concurrent.futures.Future[None]) -> None:
    """A release's end (on the client's loop thread): a refusal only means the daemon
    forgot the request already, and nothing leaks."""
    if not done.cancelled() and (exc := done.exception()) is not None:
        log.debug("request %s: release: %s", req_id, exc)


class Transfers:
    """The transfers of one worker. `connect` dials the daemon and registers the pool,
    returning the client (DaemonGoneError / CallError if it cannot)."""

    def __init__(
        self,
        connect: Callable[[], Client],
        pool_id: str,
        client: Client | None = None,
        idle_wait_s: float = 0.005,
        record: Callable[[dict[str, object]], None] | None = None,
    ) -> None:
        self._connect = connect
        self.pool_id = pool_id
        self._client = client
        self._last_dial = 0.0
        self._dialing: concurrent.futures.Future[Client] | None = None  # _client_or_dial
        self._idle_wait_s = idle_wait_s
        self._record = record  # each reported transfer's outcome (kv_connector_extra_config)
        self._entries: dict[str, _Entry] = {}  # by vLLM request id
        self._ready: Results = Results(set(), set(), set())
        self._let_go = LetGo()  # ended connections of daemons that live on

    @property
    def pending(self) -> int:
        return len(self._entries)

    # ----------------------------------------------------------------- posting

    def _drop_if_gone(self) -> None:
        """A connection the daemon ended fails what was in flight on it. Noticed only when
        there is work (vLLM may have idled meanwhile), so the daemon may well be back."""
        if self._client is not None and self._client.gone:
            self._lost(DaemonGoneError(self._client.gone))

    def _client_or_dial(self, wait: bool = True) -> Client | None:
        """The client, or None while there is none (a dial is started at most once a
        second, on its own thread). A dial started here is waited for up to _DIAL_WAIT_S
        when `wait`; one still under way (a stopped or overloaded daemon: the client's
        connect and hello may take 20 s) is picked up by a later step, so vLLM's loop is
        never held for longer."""
        self._drop_if_gone()
        if self._client is not None:
            return self._client
        dialing = self._dialing
        if dialing is None:
            now = time.monotonic()
            if now - self._last_dial < _REDIAL_EVERY_S:
                return None
            self._last_dial = now
            dialing = self._dialing = _in_background(self._connect)
            if wait:
                concurrent.futures.wait([dialing], _DIAL_WAIT_S)
        if not dialing.done():
            return None
        self._dialing = None
        self._last_dial = time.monotonic()  # the next dial a second after this one ended
        exc = dialing.exception()
        if exc is not None:
            log.warning("the kvxferd daemon is not back: %s", exc)
            return None
        self._client = dialing.result()
        log.warning("reconnected to the kvxferd daemon")
        return self._client

    def _lost(self, exc: Exception) -> None:
        """The connection to the daemon ended: its transfers fail. One whose blocks the
        daemon may still touch waits for the daemon's process to exit (the module's
        docstring)."""
        client, self._client = self._client, None
        self._last_dial = 0.0  # dial again as soon as there is work (then once a second)
        current = [(i, e) for i, e in self._entries.items() if e.orphan_of is None]
        if client is None:
            for req_id, entry in current:
                self._finish(req_id, entry, failed=True)
            return
        log.error("lost the kvxferd daemon (%s); %d transfers fail", exc, len(current))
        with contextlib.suppress(Exception):  # closing a dead connection may fail any way
            client.close()
        daemon = client.daemon_process
        # _may_be_touched takes outcomes that arrived: a receive done just before the end
        # is done.
        touched = [(i, e) for i, e in current if _may_be_touched(e, client)]
        state = alive(daemon) if touched else False
        if state is None:
            log.warning(
                "cannot watch the kvxferd daemon's process from here (another pid namespace, "
                "no pidfd, an unreadable /proc, or an older daemon); %d transfer(s) fail now "
                "although their blocks may still be written or read if it lives on",
                len(touched),
            )
        elif state:
            log.error(
                "the kvxferd daemon (pid %d) may still write or read the blocks of %d "
                "transfer(s): they fail once its process exits",
                daemon.pid,
                len(touched),
            )
            for _, entry in touched:
                entry.orphan_of = daemon
                entry.orphan_conn = client.connection_id
        for req_id, entry in current:
            if entry.orphan_of is None:
                done = entry.outcome is not None and entry.outcome.status == "done"
                self._finish(req_id, entry, failed=not done)

    def post(self, plan: StepPlan) -> None:
        if self._post(plan) and self._client is not None:
            # The started calls leave now, before vLLM's forward pass takes the GIL (one hop
            # to the client's loop thread for the step, not a round trip per call).
            try:
                self._client.flush(_FLUSH_S)
            except TimeoutError:
                # A starved process, not a lost daemon: the calls are queued in order and go
                # out when the client's thread runs.
                log.warning(
                    "the kvxferd client's thread did not send this step's calls within %g s "
                    "(is the process starved?); they go out when it runs",
                    _FLUSH_S,
                )
            except (DaemonGoneError, OSError) as exc:
                self._lost(exc)

    def _post(self, plan: StepPlan) -> bool:
        """Enter the plan's transfers and start their calls; whether any call was made."""
        made = False
        for refusal in plan.refusals:
            log.warning("request %s: remote KV load refused: %s", refusal.req_id, refusal.reason)
            self._ready.recving.add(refusal.req_id)
            self._ready.failed.add(refusal.req_id)
        for recv in plan.recvs:
            made |= self._start(
                recv.req_id,
                _Entry(recv.transfer_id, "recv"),
                lambda c, r=recv: c.start_recv(  # type: ignore[misc]
                    r.transfer_id,
                    self.pool_id,
                    r.blocks,
                    r.peer,
                    r.num_tokens,
                    block_start=r.block_start,
                    auto_release=True,  # release below then asks nothing of the daemon
                ),
            )
        for send in plan.sends:
            made |= self._start(
                send.req_id,
                _Entry(send.transfer_id, "send"),
                lambda c, s=send: c.start_send(  # type: ignore[misc]
                    s.transfer_id,
                    self.pool_id,
                    s.blocks,
                    s.num_tokens,
                    peer=s.peer or None,
                    auto_release=True,
                ),
            )
        return made

    def _start(
        self,
        req_id: str,
        entry: _Entry,
        call: Callable[[Client], concurrent.futures.Future[Outcome]],
    ) -> bool:
        """Enter a planned transfer (reported once from now on) and start its call; False
        when there is no daemon to call (the transfer failed)."""
        self._entries[req_id] = entry
        client = self._client_or_dial()
        if client is None:
            log.warning("request %s: no kvxferd daemon to %s with", req_id, entry.side)
            self._finish(req_id, entry, failed=True)
            return False
        # Whatever stops the call (a refusal, the connection's end) fails this future, and
        # _advance takes it from there: nothing raises here.
        entry.started = call(client)
        return True

    def _refused(self, req_id: str, entry: _Entry, exc: BaseException) -> None:
        log.warning("request %s: the daemon refused the %s: %s", req_id, entry.side, exc)
        entry.released = True  # never accepted: nothing to forget
        self._finish(req_id, entry, failed=True)

    # -------------------------------------------------------------- collecting

    def collect(self, finished_req_ids: set[str], idle: bool = False) -> Results:
        """What to tell vLLM this step (each id once, ever)."""
        for req_id in finished_req_ids:
            entry = self._entries.get(req_id)
            if entry is None:
                continue
            entry.seen_finished = True
            if entry.side == "recv" and entry.outcome is None:
                entry.aborted = True
        self._drop_if_gone()
        if self._client is None and any(
            e.orphan_of is not None and e.orphan_conn for e in self._entries.values()
        ):
            self._client_or_dial(wait=False)  # to ask whether the daemon let go of them
        try:
            if idle:
                self._wait_a_little()
            for req_id, entry in list(self._entries.items()):
                self._advance(req_id, entry)
        except (DaemonGoneError, OSError, TimeoutError) as exc:
            self._lost(exc)
        out, self._ready = self._ready, Results(set(), set(), set())
        return out

    def _wait_a_little(self) -> None:
        """A step with nothing to compute comes right back (vLLM loops while transfers are
        pending, ~600 steps/s): wait briefly for an outcome (or a refusal) instead of
        spinning the CPU the daemons need to move the bytes."""
        waiting = [
            e.started
            for e in self._entries.values()
            if e.outcome is None and not e.failed and e.started is not None and not e.orphan_of
        ]
        if self._client is not None and waiting:
            concurrent.futures.wait(waiting, self._idle_wait_s, concurrent.futures.FIRST_COMPLETED)
        elif any(e.orphan_of is not None for e in self._entries.values()):
            time.sleep(self._idle_wait_s)  # only a daemon's exit is awaited: no future for it

    def _advance(self, req_id: str, entry: _Entry) -> None:
        if entry.orphan_of is not None:
            if alive(entry.orphan_of) is False or self._let_go.of(
                entry.orphan_of, entry.orphan_conn, self._client
            ):
                entry.orphan_of = None  # nothing of it can be touched now: a plain failure
                self._finish(req_id, entry, failed=True)
            return
        if entry.failed:  # a send that failed without an outcome, held back (see _finish)
            if entry.seen_finished:
                self._finish(req_id, entry, failed=True)
            return
        client = self._client
        if client is None:
            return
        exc = _settle(entry)
        if isinstance(exc, (DaemonGoneError, OSError, TimeoutError)):
            raise exc  # the connection's end: collect fails every entry (_lost)
        if exc is not None:  # refused (CallError), or a bad argument: this one fails
            self._refused(req_id, entry, exc)
            return
        if entry.outcome is None:
            if entry.aborted:
                self._cancel(req_id, entry, client)
            return
        outcome = entry.outcome
        failed = outcome.status != "done"
        if not entry.released:
            entry.released = True
            # Not waited for (a hop to the client's loop thread each, in a step that may
            # report dozens): auto-released, it only drops the outcome the client kept.
            client.start_release(entry.transfer_id).add_done_callback(
                partial(_release_ended, req_id)
            )
            if failed and not entry.aborted:
                log.warning(
                    "request %s: KV %s of transfer %s %s: %s %s",
                    req_id,
                    entry.side,
                    entry.transfer_id,
                    outcome.status,
                    outcome.reason,
                    # It may quote the other daemon's peer: bounded, as the daemon's own logs.
                    shown(outcome.message, TEXT_LIMIT, quote=False),
                )
        if outcome.blocks_held and client.released(entry.transfer_id) is None:
            return  # a write may still land: the blocks stay vLLM's-but-lent until fenced
        if entry.side == "send" and not entry.seen_finished:
            return  # vLLM's rule: a send is reported only after its request finished
        self._finish(req_id, entry, failed=failed)

    def _cancel(self, req_id: str, entry: _Entry, client: Client) -> None:
        """Ask the daemon to cancel an aborted receive, without waiting for its answer: a
        daemon that is stopped (SIGSTOP) or busy must not stop vLLM's loop, and until it
        answers nothing is reported (it, or its context daemon, may still write into the
        blocks). "cancelled" and "finished" both mean an outcome is on its way; "busy"
        means a write is in flight: asked again at the next step."""
        asked = entry.cancel
        if entry.cancel_answered or (asked is not None and not asked.done()):
            return
        if asked is not None:
            exc = asked.exception()
            if isinstance(exc, (DaemonGoneError, OSError)):
                raise exc  # the connection's end: collect fails every entry (_lost)
            if exc is not None or asked.result() != "busy":
                entry.cancel_answered = True
                if exc is not None:  # the receive itself was refused, most likely
                    log.warning("request %s: cancel refused: %s", req_id, exc)
                return
        entry.cancel = client.start_cancel(entry.transfer_id)

    def _finish(self, req_id: str, entry: _Entry, *, failed: bool) -> None:
        if entry.side == "send" and not entry.seen_finished:
            # A send refused, or whose daemon went away, before vLLM named its request in
            # finished_req_ids: reporting it now would free the blocks of a running request.
            # It stays an entry, failed, and _advance reports it once vLLM finished it.
            entry.failed = True
            return
        self._entries.pop(req_id, None)
        if self._record is not None:
            o = entry.outcome
            self._record(
                {
                    "transfer_id": entry.transfer_id,
                    "request_id": req_id,
                    "side": entry.side,
                    "status": o.status if o else "not_posted",
                    "reason": o.reason if o else "",
                    "nbytes": o.nbytes if o else 0,
                    "elapsed_ms": o.elapsed_ms if o else 0.0,
                    "aborted": entry.aborted,
                    "reported_unix_ms": int(time.time() * 1000),
                }
            )
        if entry.side == "send":
            self._ready.sending.add(req_id)
            return
        self._ready.recving.add(req_id)
        if failed:
            self._ready.failed.add(req_id)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._dialing is not None:  # its client, if it comes, is closed as it comes
            self._dialing.add_done_callback(_close_dialed)
            self._dialing = None


def _in_background(connect: Callable[[], Client]) -> concurrent.futures.Future[Client]:
    """`connect()` on a thread of its own; the future of its client. A daemon thread, not
    a ThreadPoolExecutor's: those are joined at exit, and a dial to a stopped daemon
    would hold vLLM's exit for its 20 s."""
    out: concurrent.futures.Future[Client] = concurrent.futures.Future()

    def dial() -> None:
        try:
            out.set_result(connect())
        except BaseException as exc:  # the step that picks it up logs it
            out.set_exception(exc)

    threading.Thread(target=dial, name="kvxferd-dial", daemon=True).start()
    return out


def _close_dialed(dialed: concurrent.futures.Future[Client]) -> None:
    if dialed.exception() is None:
        dialed.result().close()

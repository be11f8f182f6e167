"""The blocking engine client: AsyncClient's calls, run on a private loop thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvxferd.client.aio import AsyncClient
from kvxferd.client.book import Released
from kvxferd.client.errors import DaemonGoneError
from kvxferd.transceiver.state import Outcome

T = TypeVar("T")
P = ParamSpec("P")


def _blocking(
    method: Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[Client, P], T]:
    """The Client method for AsyncClient's `method`: the same parameters and docstring; it
    runs the call on the client's loop thread and returns its result."""

    def call(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(method(self._client, *args, **kwargs))

    functools.update_wrapper(call, method)
    call.__qualname__ = f"Client.{method.__name__}"
    return call


def _chained(
    fut: asyncio.Future[Outcome],
    loop: asyncio.AbstractEventLoop,
    out: concurrent.futures.Future[Outcome],
) -> None:
    """`out` ends as `fut` does (told on `loop`'s thread); cancelling `out` (before or
    after) cancels `fut`, which leaves the request to the daemon."""

    def ended(f: asyncio.Future[Outcome]) -> None:
        try:
            if f.cancelled():
                out.cancel()
            elif (exc := f.exception()) is not None:
                out.set_exception(exc)
            else:
                out.set_result(f.result())
        except concurrent.futures.InvalidStateError:
            pass  # the engine's thread cancelled it meanwhile

    def cancelled(o: concurrent.futures.Future[Outcome]) -> None:
        if o.cancelled():
            with contextlib.suppress(RuntimeError):  # the client closed: nothing to stop
                loop.call_soon_threadsafe(fut.cancel)

    fut.add_done_callback(ended)
    out.add_done_callback(cancelled)


def _started(
    method: Callable[Concatenate[AsyncClient, P], asyncio.Future[Outcome]],
) -> Callable[Concatenate[Client, P], concurrent.futures.Future[Outcome]]:
    """The Client method for AsyncClient's start_recv / start_send: the same parameters;
    it hands the call to the loop thread and returns a concurrent.futures.Future of the
    outcome at once (the call's own errors fail the future)."""

    def call(
        self: Client, /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[Outcome]:
        return self._start(functools.partial(method, self._client, *args, **kwargs))

    functools.update_wrapper(call, method)
    call.__qualname__ = f"Client.{method.__name__}"
    # What help() and IDEs show: AsyncClient's parameters, this future.
    call.__signature__ = inspect.signature(method).replace(  # type: ignore[attr-defined]
        return_annotation="concurrent.futures.Future[Outcome]"
    )
    call.__doc__ = f"""{method.__doc__}

        Client: the future is a concurrent.futures.Future (`.result(timeout)`, or
        asyncio.wrap_future on another loop), handed out at once: the call is queued for
        the client's loop thread, which makes it in order with this thread's other calls,
        and nothing here waits for that thread or the daemon (an engine starts a step's
        requests without a round trip each). Everything that stops the call fails the
        future: a bad argument (ValueError), a refusal here or by the daemon
        (CallError), the connection's end or a closed client (DaemonGoneError).
        Cancelling it cancels the request's wait, not the request (cancel does). Its
        done callbacks may run on the client's loop thread: a blocking call of this
        client made there raises RuntimeError (it would wait for that thread); a start
        may be made there."""
    return call


class Client:
    """Blocking client: the same calls as AsyncClient, run on a private loop thread."""

    def __init__(self, socket_path: str, engine: str = "engine", timeout_s: float = 10.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvxferd-client", daemon=True
        )
        self._thread.start()
        # Futures the start_* calls handed out that have not ended (failed at close).
        self._started: set[concurrent.futures.Future[Any]] = set()
        try:
            self._client = self._run(AsyncClient.connect(socket_path, engine, timeout_s))
        except BaseException:
            self._stop_loop()
            raise
        self.daemon = self._client.daemon
        self.role = self._client.role
        self.tokens_per_block = self._client.tokens_per_block
        self.daemon_process = self._client.daemon_process
        self.connection_id = self._client.connection_id

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            # It would wait for the thread it blocks: a done callback of a started
            # request's future runs there.
            raise RuntimeError(
                "a blocking kvxferd Client call made on the client's own loop thread (from "
                "a done callback of a start_send/start_recv future?) would wait forever; "
                "call it from another thread"
            )
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError("no answer from the kvxferd daemon in time") from None

    # The calls: AsyncClient's, with their parameters and docs, waited for on the loop thread.
    register_pool = _blocking(AsyncClient.register_pool)
    register_memfd_pool = _blocking(AsyncClient.register_memfd_pool)
    register_device_pool = _blocking(AsyncClient.register_device_pool)
    register_ipc_pool = _blocking(AsyncClient.register_ipc_pool)
    register_vmm_pool = _blocking(AsyncClient.register_vmm_pool)
    deregister_pool = _blocking(AsyncClient.deregister_pool)
    recv = _blocking(AsyncClient.recv)
    send = _blocking(AsyncClient.send)
    cancel = _blocking(AsyncClient.cancel)
    release = _blocking(AsyncClient.release)
    query = _blocking(AsyncClient.query)
    connection_state = _blocking(AsyncClient.connection_state)
    fence_writer = _blocking(AsyncClient.fence_writer)
    wait = _blocking(AsyncClient.wait)

    # Started, not waited for: AsyncClient's, handing out a concurrent future (_started).
    start_recv = _started(AsyncClient.start_recv)
    start_send = _started(AsyncClient.start_send)

    def _start(
        self, start: Callable[[], asyncio.Future[Outcome]]
    ) -> concurrent.futures.Future[Outcome]:
        """Queue `start` for the loop thread and hand out, at once, a future this thread can
        wait on: it ends as `start`'s does, or with what `start` raised. Queued calls run in
        the order they were made (call_soon_threadsafe, as `_run` queues the blocking
        calls), so a cancel or wait made after a start finds it."""
        out: concurrent.futures.Future[Outcome] = self._handed_out(concurrent.futures.Future())

        def begin() -> None:
            try:
                fut = start()
            except Exception as exc:  # the caller sees it through the future
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    out.set_exception(exc)
                return
            _chained(fut, self._loop, out)

        try:
            self._loop.call_soon_threadsafe(begin)
        except RuntimeError:  # the loop is closed: so is the client
            out.set_exception(DaemonGoneError("client closed"))
        return out

    def _handed_out(self, out: concurrent.futures.Future[T]) -> concurrent.futures.Future[T]:
        """`out`, kept until it ends: close fails it if it has not ended by then."""
        self._started.add(out)
        out.add_done_callback(self._started.discard)
        return out

    def start_cancel(
        self, request_id: str, peer: str | None = None
    ) -> concurrent.futures.Future[str]:
        """cancel, queued like start_recv and not waited for: the future of its answer
        ("cancelled", "busy" or "finished"), failing as cancel raises. For an engine
        whose loop must not stop while its daemon is stopped (SIGSTOP) or busy: the
        daemon answers when it runs again."""
        return self._queued(self._client.cancel(request_id, peer))

    def start_release(
        self, request_id: str, peer: str | None = None
    ) -> concurrent.futures.Future[None]:
        """release, queued like start_cancel and not waited for: the future of its end,
        failing as release raises. A request the daemon auto-released only drops its
        outcome here; the others ask the daemon. Calls made after it see it done."""
        return self._queued(self._client.release(request_id, peer))

    def start_connection_state(self, connection: int) -> concurrent.futures.Future[str]:
        """connection_state, queued like start_cancel and not waited for: the future of its
        answer, failing as connection_state raises."""
        return self._queued(self._client.connection_state(connection))

    def _queued(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coro` on the loop thread, queued, and hand out its future at once; close
        fails it if it has not ended by then."""
        try:
            return self._handed_out(asyncio.run_coroutine_threadsafe(coro, self._loop))
        except RuntimeError:  # the loop is closed: so is the client
            coro.close()
            closed: concurrent.futures.Future[T] = concurrent.futures.Future()
            closed.set_exception(DaemonGoneError("client closed"))
            return closed

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until the calls started before it (start_recv / start_send) were made and
        handed to the socket: one hop to the loop thread for all of them. An engine that
        starts a step's requests and then computes calls it once after the starts: the
        loop thread needs the GIL to make them, and a thread busy in Python lends it only
        every switch interval (5 ms), so the requests would leave late."""

        async def written() -> None:
            self._client.flush()

        self._run(written(), timeout_s)

    def poll(
        self, request_id: str, side: str | None = None, peer: str | None = None
    ) -> Outcome | None:
        return self._client.poll(request_id, side, peer)

    def released(self, request_id: str, peer: str | None = None) -> Released | None:
        return self._client.released(request_id, peer)

    @property
    def gone(self) -> str:
        """Why the connection to the daemon ended; "" while it is up."""
        return self._client.gone

    def wait_released(
        self, request_id: str, timeout_s: float | None = None, peer: str | None = None
    ) -> Released:
        return self._run(self._client.wait_released(request_id, timeout_s, peer), timeout_s)

    def close(self) -> None:
        try:
            self._run(self._client.close(), 5.0)
        finally:
            self._stop_loop()
            # Ended by the connection's end as it closed, unless the close timed out.
            for out in list(self._started):
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    out.set_exception(DaemonGoneError("client closed"))

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The worker: one WebSocket connection, leases in, results out (docs/protocol.md).

:class:`Worker` is what a program runs, starts, drains and stops. It composes the
connection (orbit_sdk._connection: connect, reconnect, hello, requests and replies), the
attempts it holds (orbit_sdk._attempts: start, renew, run the handler, report, resume) and
the protocol's frames (orbit_sdk._protocol). All state lives on the event loop thread;
``drain()`` and ``stop()`` only schedule work on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import threading
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any

from websockets.exceptions import InvalidURI
from websockets.uri import parse_uri

from orbit_sdk._attempts import Attempts, Handler
from orbit_sdk._checks import check_positive_seconds, check_seconds, check_token
from orbit_sdk._connection import Connection, Link, LinkEvents, NoAnswer
from orbit_sdk._credentials import load_credentials
from orbit_sdk._models import TaskInfo
from orbit_sdk._protocol import hello_frame, websocket_url

logger = logging.getLogger("orbit_sdk.worker")

HandlerKey = tuple[str, str] | str
# Mapping is invariant in its key: a table built beforehand is typed by the keys it holds
# (dict[tuple[str, str], ...]), which Mapping[HandlerKey, ...] alone would refuse.
Handlers = Mapping[tuple[str, str], Handler] | Mapping[str, Handler] | Mapping[HandlerKey, Handler]


def default_worker_id() -> str:
    host = "".join(ch for ch in socket.gethostname() if 0x21 <= ord(ch) <= 0x7E)[:80] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


class Worker:
    """Consumes ``queues``, running ``handlers`` for the tasks it is assigned.

    ``handlers`` maps ``(handler, handler_version)`` — or a bare handler name, meaning any
    version — to a callable taking an :class:`Execution`. Sync callables run in a daemon thread
    of their own (one per running attempt); coroutine functions run on the worker's loop. The return value is
    reported as SUCCEEDED with that output (``None`` → no output); :class:`RetryableError` →
    FAILED retryable; :class:`UnknownOutcome` → UNKNOWN; any other exception → FAILED, not
    retryable, error ``{"type": <class name>, "message": str(exc)}``.

    When every key is a tuple the hello advertises exactly those pairs; one bare name makes it
    advertise ``[]`` (any handler) and assignments the worker cannot serve are released with
    reason ``"no handler"`` after a one-second hold (at once, the server would assign them
    straight back), with a warning once per handler and version.

    ``request_timeout`` (how long a request waits for its reply), ``min_reconnect_delay`` and
    ``max_reconnect_delay`` (the reconnect delay doubles from one to the other) are seconds:
    finite numbers above zero, the minimum at most the maximum. They, the token (as the
    Client checks it) and the url are checked here, a TypeError or ValueError naming what is
    wrong: none of them fails later, inside the run, or makes it reconnect in a loop.
    """

    def __init__(
        self,
        url: str,
        token: str,
        queues: Iterable[str],
        handlers: Handlers,
        capacity: int = 1,
        concurrency_keys: bool = True,
        *,
        worker_id: str | None = None,
        version: str = "orbit-python/0.1",
        request_timeout: float = 15.0,
        min_reconnect_delay: float = 0.5,
        max_reconnect_delay: float = 30.0,
        namespace_id: str | None = None,
    ) -> None:
        self.url = websocket_url(url)
        try:
            parse_uri(self.url)  # what websockets will check on every connect
        except InvalidURI as exc:
            raise ValueError(f"url is not usable for the worker's WebSocket: {exc.msg}") from None
        # The same check as the Client's: a token the Authorization header cannot carry would
        # otherwise fail every connect, in a loop that no reconnect can end.
        token = check_token(token)
        request_timeout = check_positive_seconds(request_timeout, "request_timeout")
        min_reconnect_delay = check_positive_seconds(min_reconnect_delay, "min_reconnect_delay")
        max_reconnect_delay = check_positive_seconds(max_reconnect_delay, "max_reconnect_delay")
        if min_reconnect_delay > max_reconnect_delay:
            raise ValueError(
                f"min_reconnect_delay ({min_reconnect_delay}) must not exceed "
                f"max_reconnect_delay ({max_reconnect_delay})"
            )
        if isinstance(queues, str):  # a list of one id was meant, not its characters
            raise ValueError("queues must be a list of queue ids, not a string")
        self.queues = list(queues)
        if not self.queues or not all(isinstance(queue, str) and queue for queue in self.queues):
            raise ValueError("queues must be a non-empty list of queue ids")
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(f"capacity must be an int between 1 and 1000, got {type(capacity).__name__}")
        if not 1 <= capacity <= 1000:
            raise ValueError("capacity must be an int between 1 and 1000")
        self.capacity = capacity
        if not isinstance(concurrency_keys, bool):  # "false" would be true
            raise TypeError(f"concurrency_keys must be a bool, got {type(concurrency_keys).__name__}")
        self.concurrency_keys = concurrency_keys
        self.worker_id = worker_id if worker_id is not None else default_worker_id()
        if not isinstance(self.worker_id, str):
            raise TypeError(f"worker_id must be a string, got {type(self.worker_id).__name__}")
        if not 1 <= len(self.worker_id) <= 128 or not all(0x21 <= ord(ch) <= 0x7E for ch in self.worker_id):
            raise ValueError("worker_id must be 1-128 printable ASCII characters without spaces")
        self.version = version
        self.namespace_id = namespace_id  # given to each Execution, for fencing (hello.ok does not carry it)

        self._exact: dict[tuple[str, str], Handler] = {}
        self._any_version: dict[str, Handler] = {}
        for key, handler in handlers.items():
            if not callable(handler):
                raise TypeError(f"handler for {key!r} is not callable")
            if isinstance(key, str) and key:
                self._any_version[key] = handler
            elif isinstance(key, tuple) and len(key) == 2 and all(isinstance(part, str) and part for part in key):
                self._exact[key] = handler
            else:
                raise ValueError(f"handler key must be 'name' or ('name', 'version'), got {key!r}")
        if not self._exact and not self._any_version:
            raise ValueError("at least one handler is required")
        # A bare name goes out without a version: the server leases any version of it, and
        # nothing this worker has no handler for.
        advertised: list[dict[str, str]] = [{"handler": name} for name in self._any_version]
        advertised += [
            {"handler": name, "handler_version": version}
            for name, version in self._exact
            if name not in self._any_version
        ]

        # Thread-safe control surface.
        self._control = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ran = False
        self._drain_before_start = False
        self._stop_before_start = False
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None  # set by start()
        self._error: BaseException | None = None  # what ended a start()ed run

        # Loop state (touched only on the loop thread once run_async starts).
        self._tasks: set[asyncio.Task[Any]] = set()
        self._exit = asyncio.Event()  # the run is over: drained, or stopped
        self._link = Link(
            LinkEvents(
                on_hello=self._on_hello,
                on_ready=self._on_ready,
                on_assign=self._on_assign,
                check_finished=self._check_finished,
                spawn=self._spawn,
            ),
            url=self.url,
            token=token,
            worker_id=self.worker_id,
            hello=hello_frame(
                worker_id=self.worker_id,
                queues=self.queues,
                capacity=self.capacity,
                handlers=advertised,
                concurrency_keys=self.concurrency_keys,
                version=self.version,
            ),
            done=self._exit,
            request_timeout=request_timeout,
            min_reconnect_delay=min_reconnect_delay,
            max_reconnect_delay=max_reconnect_delay,
        )
        self._attempts = Attempts(
            self,
            self._link,
            handler_for=self._handler_for,
            spawn=self._spawn,
            check_finished=self._check_finished,
        )

    @property
    def session_id(self) -> str | None:
        """The server's id for the current (or last) connection's session, from hello.ok."""
        return self._link.session_id

    @classmethod
    def from_credentials_file(
        cls,
        queues: Iterable[str],
        handlers: Handlers,
        capacity: int = 1,
        concurrency_keys: bool = True,
        *,
        path: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> Worker:
        """A worker from ``path`` or ``$ORBIT_CREDENTIALS_FILE`` (JSON with ``url`` and ``token``)."""
        credentials = load_credentials(path)
        kwargs.setdefault("namespace_id", credentials.namespace_id)
        return cls(credentials.url, credentials.token, queues, handlers, capacity, concurrency_keys, **kwargs)

    # ------------------------------------------------------------------ public control

    def run(self, *, handle_signals: bool = True) -> None:
        """Run until drained or stopped (blocking; owns an event loop via ``asyncio.run``).

        Called on the main thread with ``handle_signals`` (the default), SIGTERM and SIGINT
        stop the worker gracefully, as :meth:`drain` does: the server is told ``drain`` (no
        new leases), attempts not yet started are handed back, running handlers finish (their
        leases renewed meanwhile), their results are acknowledged, then the connection closes
        and ``run`` returns. A second signal ends it at once, as :meth:`stop` with
        ``timeout=0``: handlers still running are abandoned, sync ones included (their daemon
        threads are not waited for), and their attempts left to their leases. The previous
        signal handlers are restored when ``run`` returns.
        """
        with self._control:
            if self._ran:
                raise RuntimeError("a Worker runs once; create a new one")
        asyncio.run(self.run_async(handle_signals=handle_signals))

    async def run_async(self, *, handle_signals: bool = False) -> None:
        """Run on the current loop until drained or stopped.

        Raises :class:`APIError` when the server refuses the worker for good (bad token, missing
        scope, a hello it rejects, ``concurrency_keys`` changed for this ``worker_id``). With
        ``handle_signals`` (off here: the loop's owner usually owns the signals too), SIGTERM and
        SIGINT drain as in :meth:`run`; only on the main thread.
        """
        with self._control:
            if self._ran:
                raise RuntimeError("a Worker runs once; create a new one")
            self._ran = True
            self._loop = asyncio.get_running_loop()
            drain_first, stop_first = self._drain_before_start, self._stop_before_start
        renewer = asyncio.create_task(self._attempts.renew_loop())
        restore = self._install_signal_handlers() if handle_signals else {}
        try:
            if stop_first:
                self._on_stop()
            if drain_first:
                self._begin_drain()
            await self._link.run()
        finally:
            for signum, previous in restore.items():
                signal.signal(signum, previous)
            renewer.cancel()
            pending = [renewer, *self._tasks]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self._finished.set()

    def start(self) -> None:
        """Run in a background thread, for embedding in another program; returns at once.

        End it with :meth:`stop` (graceful) and wait with :meth:`join`, which raises what ended
        the run if it was an error (e.g. :class:`APIError` for a refused token). The thread is a
        daemon: a program that exits without ``stop()`` abandons its in-flight attempts (their
        leases run out on the server). Signals stay the embedding program's own.
        """
        with self._control:
            if self._ran or self._thread is not None:
                raise RuntimeError("a Worker runs once; create a new one")
            self._thread = threading.Thread(
                target=self._run_in_thread, name=f"orbit-worker-{self.worker_id}", daemon=True
            )
        self._thread.start()

    def _run_in_thread(self) -> None:
        try:
            asyncio.run(self.run_async())
        except BaseException as exc:  # handed to join(); a thread has no caller to raise to
            logger.error("orbit worker %s: run ended with %s", self.worker_id, self._link.redact(repr(exc)))
            self._error = exc

    def drain(self) -> None:
        """Stop taking work, let in-flight attempts finish and report, then end ``run``.

        Thread-safe and non-blocking: call it from any thread or from a handler; use
        :meth:`join` to wait for the end. Attempts not yet started are released.
        """
        with self._control:
            loop = self._loop
            if loop is None:
                self._drain_before_start = True
                return
        if not self._finished.is_set():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing left to drain
                loop.call_soon_threadsafe(self._begin_drain)

    def stop(self, timeout: float | None = None) -> None:
        """Stop gracefully, as :meth:`drain` does; after ``timeout`` seconds, if in-flight work
        has still not finished and reported, end at once (those attempts' leases run out on
        the server: a running one then needs review). ``timeout=0`` ends at once.

        Thread-safe and non-blocking (callable from a handler); :meth:`join` waits for the end.
        Ending at once abandons handlers still running: ``run()`` returns without waiting for
        them, no result is sent for them, and a sync handler's daemon thread is not interrupted
        (it goes on until it returns, or until the process exits); its return value is dropped.
        """
        timeout = check_seconds(timeout, "timeout", allow_none=True, allow_zero=True)
        with self._control:
            loop = self._loop
            if loop is None:
                if timeout == 0:
                    self._stop_before_start = True
                else:
                    self._drain_before_start = True
                return
        if not self._finished.is_set():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing left to stop
                loop.call_soon_threadsafe(self._stop_within, timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait (from another thread) until ``run`` has ended; True if it has.

        For a worker started with :meth:`start`, raises the exception that ended its run, if any.
        A worker never started (neither :meth:`start`, :meth:`run` nor :meth:`run_async` called
        yet) has nothing to wait for: True at once, so ``stop(); join()`` in a ``finally`` does
        not hang when an earlier step failed before the start.
        """
        with self._control:
            thread = self._thread
            if thread is None and not self._ran:
                return True
        if thread is None:
            return self._finished.wait(timeout)
        thread.join(timeout)
        if thread.is_alive():
            return False
        if self._error is not None:
            raise self._error
        return True

    def _stop_within(self, timeout: float | None) -> None:
        if timeout == 0:
            self._on_stop()
            return
        self._begin_drain()
        if timeout is not None:
            assert self._loop is not None
            self._loop.call_later(timeout, self._stop_overdue, timeout)

    def _stop_overdue(self, timeout: float) -> None:
        if not self._exit.is_set():
            logger.warning(
                "orbit worker %s: in-flight work not done %.1f s after stop(); stopping now", self.worker_id, timeout
            )
            self._on_stop()

    def _install_signal_handlers(self) -> dict[int, Any]:
        """SIGTERM and SIGINT → graceful stop; returns the handlers they replace."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        loop = asyncio.get_running_loop()

        def on_signal(signum: int, frame: Any) -> None:
            loop.call_soon_threadsafe(self._on_signal, signal.Signals(signum).name)

        previous: dict[int, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, on_signal)
        return previous

    def _on_signal(self, name: str) -> None:
        if self._attempts.draining:
            logger.warning("orbit worker %s: %s again: stopping now", self.worker_id, name)
            self._on_stop()
            return
        logger.info(
            "orbit worker %s: %s: stopping gracefully (no new leases; running handlers finish and report; "
            "send it again to stop at once)",
            self.worker_id,
            name,
        )
        self._begin_drain()

    def _spawn(self, coroutine: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("orbit worker %s: internal task failed", self.worker_id, exc_info=task.exception())

    def _handler_for(self, task: TaskInfo) -> Handler | None:
        return self._exact.get((task.handler, task.handler_version)) or self._any_version.get(task.handler)

    # ------------------------------------------------------------------ what the link tells

    async def _on_hello(self, conn: Connection, held: list[Any]) -> None:
        self._attempts.on_hello()
        await self._attempts.reconcile(conn, held)

    def _on_ready(self, conn: Connection) -> None:
        if self._attempts.draining:
            self._spawn(self._send_drain(conn))
        self._check_finished()

    def _on_assign(self, conn: Connection, frame: dict[str, Any]) -> None:
        self._attempts.on_assign(conn, frame)

    # ------------------------------------------------------------------ drain / stop

    def _begin_drain(self) -> None:
        if self._attempts.draining:
            return
        logger.info("orbit worker %s: draining", self.worker_id)
        self._attempts.drain()
        conn = self._link.conn
        if conn is not None and conn.ready:
            self._spawn(self._send_drain(conn))
        self._check_finished()

    async def _send_drain(self, conn: Connection) -> None:
        try:
            reply = await self._link.raw_call(conn, {"type": "drain"})
        except NoAnswer:
            if conn.closed:
                return  # sent again after the next hello
            reply = {"type": "error", "code": "NO_REPLY"}  # an open connection that ignores drain
        if reply.get("type") != "drain.ok":
            logger.warning("orbit worker %s: drain answered %s", self.worker_id, reply)
        conn.drain_acked = True
        self._check_finished()

    def _check_finished(self) -> None:
        attempts = self._attempts
        if not attempts.draining or attempts.held or attempts.rejected:
            return
        conn = self._link.conn
        if conn is None or conn.drain_acked:
            self._exit.set()

    def _on_stop(self) -> None:
        logger.info("orbit worker %s: stopping", self.worker_id)
        self._attempts.stopping = True
        self._exit.set()

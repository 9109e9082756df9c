"""The worker: one WebSocket connection, leases in, results out (docs/protocol.md).

Life of an attempt inside :class:`Worker`::

    task.assign ──ack──▶ leased ──task.start──▶ running ──handler──▶ reporting ──task.result.ok──▶ gone
                           │  RATE_LIMITED: wait retry_after_ms, ask again (same attempt, epoch)
                           │  QUEUE_PAUSED: back off and ask again for up to one lease, then release
                           │  LEASE_LOST / TASK_CANCELLED: dropped, the server already ended it
                           └─ draining, or a protocol error: task.release

Invariants the code relies on:

* Business code runs only after ``task.start.ok`` for that attempt and epoch.
* A result is re-sent, same content, until ``task.result.ok`` (or a definite refusal), across
  reconnects; the server answers replays from its record.
* Every held attempt (leased, running or reporting) is renewed once a third of its remaining
  lease has passed (never later than ``renew_seconds``), so short leases are kept too.
* All state lives on the event loop thread; ``drain()`` and ``stop()`` only schedule work on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import inspect
import itertools
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from orbit_sdk._credentials import load_credentials
from orbit_sdk._exceptions import (
    STATUS_OF_CODE,
    APIError,
    CancelRequested,
    ProtocolError,
    RetryableError,
    UnknownOutcome,
)
from orbit_sdk._models import TaskInfo, _object, _opt_int, _opt_str, _opt_time, parse_uint64
from orbit_sdk.fencing import headers_for

logger = logging.getLogger("orbit_sdk.worker")

Handler = Callable[["Execution"], Any]
HandlerKey = tuple[str, str] | str

CONNECT_PATH = "/v1/workers/connect"
OPEN_TIMEOUT = 10.0  # seconds for the WebSocket opening handshake
CLOSE_TIMEOUT = 2.0  # seconds to wait for the closing handshake
DEFAULT_LEASE_SECONDS = 30.0  # until hello.ok says otherwise
DEFAULT_RENEW_SECONDS = 10.0  # until hello.ok says otherwise
RENEW_TICK_SECONDS = 0.25  # how often the renewer looks for attempts whose renewal is due
MIN_RENEW_DELAY = 0.2  # seconds; floor for a renewal's delay when a lease is nearly over
QUEUE_PAUSED_BACKOFF = 0.5  # seconds before asking Start again on a paused queue; doubles up to renew_seconds
TRANSIENT_BACKOFF = 0.5  # seconds after UNAVAILABLE/INTERNAL; doubles up to renew_seconds
MAX_OUTPUT_DEPTH = 20  # the server refuses an output nested deeper (MariaDB stores JSON up to 32 levels)
MAX_OUTPUT_BYTES = 1_000_000  # a task.result frame must fit the server's 1 MiB WebSocket message limit
MAX_ERROR_MESSAGE = 4096  # characters of an exception's message reported as the error
# A task no handler of this worker serves is handed back after this long, not at once: with
# bare handler names the hello advertises every handler, and the server would assign the same
# task straight back (a lease and release a few milliseconds apart, forever).
NO_HANDLER_HOLD_SECONDS = 1.0
MISSING_RETRY_AFTER = 1.0  # seconds to wait on a RATE_LIMITED reply without retry_after_ms

# Answers that say "not now" rather than "no".
TRANSIENT_CODES = frozenset({"UNAVAILABLE", "INTERNAL"})
# Close codes after which reconnecting with the same hello cannot help.
FATAL_CLOSE_CODES = {4401: "UNAUTHENTICATED", 4403: "PERMISSION_DENIED", 4409: "STATE_CONFLICT"}
FATAL_HTTP_STATUSES = {401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND"}
# Close codes after which the worker reconnects, logging the server's error frame sent before.
CLOSE_MEANINGS = {
    1009: "a frame over the server's message size limit",
    4408: "assignments not acknowledged in time",
}


class _NoAnswer(Exception):
    """A request got no reply: the connection closed, or the reply did not come in time."""


class _Abandoned(Exception):
    """The caller no longer wants the request sent."""


class _HelloRefused(Exception):
    """The hello was answered "not now" (UNAVAILABLE, INTERNAL): reconnect and try again."""


def _fatal(code: str, message: str) -> APIError:
    return APIError(code=code, status_code=STATUS_OF_CODE.get(code, 0), message=message)


def websocket_url(url: str) -> str:
    """``http(s)://host[/prefix]`` → ``ws(s)://host[/prefix]/v1/workers/connect``."""
    parts = urlsplit(url)
    schemes = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
    if parts.scheme not in schemes or not parts.netloc:
        raise ValueError(f"expected an http(s):// or ws(s):// URL, got {url!r}")
    return urlunsplit((schemes[parts.scheme], parts.netloc, parts.path.rstrip("/") + CONNECT_PATH, "", ""))


def default_worker_id() -> str:
    host = "".join(ch for ch in socket.gethostname() if 0x21 <= ord(ch) <= 0x7E)[:80] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


# --------------------------------------------------------------------------- assignments


@dataclasses.dataclass(frozen=True)
class _Assignment:
    attempt_id: str
    epoch: int
    task: TaskInfo
    concurrency_token: int | None
    lease_expires_at: datetime.datetime | None
    state: str | None  # only in hello.ok.held and task.resume.ok
    attempt_number: int | None


def _ids_of(frame: Any) -> tuple[str, int] | None:
    """attempt_id and epoch, when readable: enough to hand a bad assignment back."""
    if not isinstance(frame, Mapping):
        return None
    attempt_id, epoch = frame.get("attempt_id"), frame.get("epoch")
    if not isinstance(attempt_id, str) or not attempt_id or isinstance(epoch, bool) or not isinstance(epoch, int):
        return None
    return attempt_id, epoch


def parse_assignment(frame: Any, *, concurrency_keys: bool) -> _Assignment:
    """Decode a task.assign (or held / resume) entry; every contract breach is a ProtocolError.

    Seed keyed-concurrency §4: a keyed task must carry a token, a token needs a key, a worker
    that did not ask for keyed tasks must not get one, and a token is a non-zero canonical
    uint64 decimal string (never a JSON number: it would lose precision beyond 2**53).
    """
    what = "assignment"
    obj = _object(frame, what)
    ids = _ids_of(obj)
    if ids is None:
        raise ProtocolError("assignment without a readable attempt_id and epoch")
    task = TaskInfo.from_json(obj.get("task"))
    if task.concurrency_key is not None and not concurrency_keys:
        raise ProtocolError("keyed task assigned to a worker that did not ask for concurrency_keys")
    has_token = "concurrency_token" in obj
    token = parse_uint64(obj["concurrency_token"], "concurrency_token", nonzero=True) if has_token else None
    if task.concurrency_key is not None and token is None:
        raise ProtocolError("keyed task without concurrency_token")
    if task.concurrency_key is None and has_token:
        raise ProtocolError("concurrency_token without a concurrency key")
    return _Assignment(
        attempt_id=ids[0],
        epoch=ids[1],
        task=task,
        concurrency_token=token,
        lease_expires_at=_opt_time(obj, "lease_expires_at", what),
        state=_opt_str(obj, "state", what),
        attempt_number=_opt_int(obj, "attempt_number", what),
    )


def _changes(known: _Assignment, new: _Assignment) -> str | None:
    """What a repeated assignment changes about an attempt we already hold, if anything."""
    for name, old_value, new_value in (
        ("epoch", known.epoch, new.epoch),
        ("task id", known.task.id, new.task.id),
        ("concurrency_key", known.task.concurrency_key, new.task.concurrency_key),
        ("concurrency_token", known.concurrency_token, new.concurrency_token),
    ):
        if old_value != new_value:
            return f"attempt {known.attempt_id}: {name} changed from {old_value!r} to {new_value!r}"
    return None


# --------------------------------------------------------------------------- execution


class Execution:
    """What a handler gets: the task, its attempt, and the cancellation signal.

    The signal is set when a renewal reports ``cancel_requested`` or when the lease is lost;
    check it with :attr:`cancelled`, :meth:`raise_if_cancelled`, :meth:`wait_cancelled`
    (blocking, for sync handlers) or ``await`` :meth:`until_cancelled` (async handlers).
    """

    def __init__(
        self,
        worker: Worker,
        assignment: _Assignment,
        attempt_number: int,
        lease_expires_at: datetime.datetime | None,
    ) -> None:
        self.worker = worker
        self.task: TaskInfo = assignment.task
        self.attempt_id: str = assignment.attempt_id
        self.attempt_number: int = attempt_number
        self.epoch: int = assignment.epoch
        self.concurrency_token: int | None = assignment.concurrency_token
        # The lease's end as the server last confirmed it: every renewal refreshes it, so a
        # resource can refuse a write from a worker paused past it (orbit_sdk.fencing).
        self.lease_expires_at: datetime.datetime | None = lease_expires_at
        # The credential's namespace (the key's scope): from Worker(namespace_id=...), which
        # Worker.from_credentials_file fills in; None when the worker was not told.
        self.namespace_id: str | None = worker.namespace_id
        self._cancel_requested = False
        self._lease_lost = False
        self._signal_threads = threading.Event()
        self._signal_loop = asyncio.Event()

    def __repr__(self) -> str:
        return f"<Execution attempt={self.attempt_id} task={self.task.id} number={self.attempt_number}>"

    @property
    def payload(self) -> Any:
        return self.task.payload

    @property
    def concurrency_key(self) -> str | None:
        return self.task.concurrency_key

    def fence_headers(self, operation_id: str) -> dict[str, str]:
        """Headers that let a fenced service (``orbit_sdk.fencing`` middleware) guard this write."""
        return headers_for(self, operation_id)

    @property
    def cancel_requested(self) -> bool:
        """The task was cancelled while running (learnt from a renewal): stop and report."""
        return self._cancel_requested

    @property
    def lease_lost(self) -> bool:
        """The server no longer counts this attempt as ours; a result is kept only as late evidence."""
        return self._lease_lost

    @property
    def cancelled(self) -> bool:
        return self._cancel_requested or self._lease_lost

    def raise_if_cancelled(self) -> None:
        if self.cancelled:
            why = "cancel requested" if self._cancel_requested else "lease lost"
            raise CancelRequested(f"attempt {self.attempt_id}: {why}")

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Block (in a sync handler's thread) until cancelled or ``timeout``; True if cancelled."""
        return self._signal_threads.wait(timeout)

    async def until_cancelled(self) -> None:
        """Return once cancelled (for async handlers, on the worker's event loop)."""
        await self._signal_loop.wait()

    def _signal(self) -> None:
        self._signal_threads.set()
        self._signal_loop.set()

    def _mark_cancel_requested(self) -> None:
        self._cancel_requested = True
        self._signal()

    def _mark_lease_lost(self) -> None:
        self._lease_lost = True
        self._signal()


# --------------------------------------------------------------------------- internal state


class _Connection:
    def __init__(self, ws: ClientConnection, generation: int) -> None:
        self.ws = ws
        self.generation = generation
        self.pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.ready = False  # hello done and held attempts resumed
        self.closed = False
        self.drain_acked = False
        self.last_error: dict[str, Any] | None = None
        self.error_was_last = False  # the last frame received was that error (it says why a close came)
        self.fatal: APIError | None = None


class _Attempt:
    def __init__(self, assignment: _Assignment, handler: Handler | None, generation: int, renew_ceiling: float) -> None:
        self.assignment = assignment
        self.handler = handler
        self.generation = generation  # the connection on which the server last confirmed it
        self.phase = "leased"  # leased → running → reporting
        self.lost = False
        self.cancel_requested = False
        self.release_reason: str | None = None  # set when a protocol error is found before Start
        self.renewing = False
        self.execution: Execution | None = None
        self.attempt_number = assignment.attempt_number or 0
        self.lease_expires_at = assignment.lease_expires_at
        self.wake = asyncio.Event()
        self.renew_due = 0.0
        self.schedule_renewal(renew_ceiling)

    def schedule_renewal(self, ceiling: float) -> None:
        """Renew when a third of the remaining lease has passed, at most `ceiling` from now."""
        delay = ceiling
        if self.lease_expires_at is not None:
            remaining = (self.lease_expires_at - datetime.datetime.now(datetime.UTC)).total_seconds()
            delay = min(ceiling, max(MIN_RENEW_DELAY, remaining / 3))
        self.renew_due = time.monotonic() + delay

    @property
    def id(self) -> str:
        return self.assignment.attempt_id

    @property
    def epoch(self) -> int:
        return self.assignment.epoch

    async def sleep(self, seconds: float) -> None:
        """Sleep, but wake early when the attempt is lost, rejected or the worker drains."""
        try:
            await asyncio.wait_for(self.wake.wait(), timeout=max(seconds, 0.0))
        except TimeoutError:
            pass
        self.wake.clear()


def _deeper_than(value: Any, levels: int) -> bool:
    """Whether JSON `value` nests lists and dicts more than `levels` deep."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth == levels:
                return True
            stack.extend((inner, depth + 1) for inner in (item.values() if isinstance(item, dict) else item))
    return False


def _failure(outcome: str, retryable: bool, exc: BaseException) -> dict[str, Any]:
    return {
        "outcome": outcome,
        "retryable": retryable,
        # A message is kept short enough for its frame (the server takes frames up to 1 MiB).
        "error": {"type": type(exc).__name__, "message": str(exc)[:MAX_ERROR_MESSAGE]},
    }


def _is_async(handler: Handler) -> bool:
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(type(handler).__call__)


def _error_code(reply: Mapping[str, Any]) -> str:
    code = reply.get("code")
    return code if isinstance(code, str) else "UNKNOWN"


def _seconds(value: Any, default: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return default
    return float(value)


# --------------------------------------------------------------------------- worker


class Worker:
    """Consumes ``queues``, running ``handlers`` for the tasks it is assigned.

    ``handlers`` maps ``(handler, handler_version)`` — or a bare handler name, meaning any
    version — to a callable taking an :class:`Execution`. Sync callables run in a thread
    (``asyncio.to_thread``); coroutine functions run on the worker's loop. The return value is
    reported as SUCCEEDED with that output (``None`` → no output); :class:`RetryableError` →
    FAILED retryable; :class:`UnknownOutcome` → UNKNOWN; any other exception → FAILED, not
    retryable, error ``{"type": <class name>, "message": str(exc)}``.

    When every key is a tuple the hello advertises exactly those pairs; one bare name makes it
    advertise ``[]`` (any handler) and assignments the worker cannot serve are released with
    reason ``"no handler"`` after a one-second hold (at once, the server would assign them
    straight back), with a warning once per handler and version.
    """

    def __init__(
        self,
        url: str,
        token: str,
        queues: Iterable[str],
        handlers: Mapping[HandlerKey, Handler],
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
        self._token = token
        if isinstance(queues, str):  # a list of one id was meant, not its characters
            raise ValueError("queues must be a list of queue ids, not a string")
        self.queues = list(queues)
        if not self.queues or not all(isinstance(queue, str) and queue for queue in self.queues):
            raise ValueError("queues must be a non-empty list of queue ids")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= 1000:
            raise ValueError("capacity must be an int between 1 and 1000")
        self.capacity = capacity
        self.concurrency_keys = bool(concurrency_keys)
        self.worker_id = worker_id if worker_id is not None else default_worker_id()
        if not 1 <= len(self.worker_id) <= 128 or not all(0x21 <= ord(ch) <= 0x7E for ch in self.worker_id):
            raise ValueError("worker_id must be 1-128 printable ASCII characters without spaces")
        self.version = version
        self.namespace_id = namespace_id  # given to each Execution, for fencing (hello.ok does not carry it)
        self._request_timeout = request_timeout
        self._min_reconnect_delay = min_reconnect_delay
        self._max_reconnect_delay = max_reconnect_delay

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
        self._advertised = (
            []
            if self._any_version
            else [{"handler": name, "handler_version": version} for name, version in self._exact]
        )

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
        self._ids = itertools.count(1)
        self._generation = 0
        self._conn: _Connection | None = None
        self._attempts: dict[str, _Attempt] = {}
        self._rejected: dict[str, tuple[int, str]] = {}  # releases not yet acknowledged
        self._unserved: set[tuple[str, str]] = set()  # (handler, version) pairs warned about once
        self._tasks: set[asyncio.Task[Any]] = set()
        self._draining = False
        self._stopping = False
        self._lease_seconds = DEFAULT_LEASE_SECONDS
        self._renew_seconds = DEFAULT_RENEW_SECONDS
        self._reconnect_delay = min_reconnect_delay
        self._closed_conn: _Connection | None = None  # the latest connection, kept to say why it closed
        self.session_id: str | None = None

    @classmethod
    def from_credentials_file(
        cls,
        queues: Iterable[str],
        handlers: Mapping[HandlerKey, Handler],
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
        ``timeout=0``. The previous signal handlers are restored when ``run`` returns.
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
        self._exit = asyncio.Event()
        self._renew_kick = asyncio.Event()
        self._ready = asyncio.Event()
        renewer = asyncio.create_task(self._renew_loop())
        restore = self._install_signal_handlers() if handle_signals else {}
        try:
            if stop_first:
                self._on_stop()
            if drain_first:
                self._begin_drain()
            await self._connection_loop()
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
            logger.error("orbit worker %s: run ended with %r", self.worker_id, exc)
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
        Sync handlers already running in a thread are not interrupted: ``run()`` returns once
        they return.
        """
        if timeout is not None and (isinstance(timeout, bool) or not timeout >= 0):
            raise ValueError("timeout must be None or a number of seconds >= 0")
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
        """
        thread = self._thread
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
        if self._draining:
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

    # ------------------------------------------------------------------ connection

    async def _connection_loop(self) -> None:
        while True:
            self._check_finished()
            if self._exit.is_set():
                return
            try:
                async with connect(
                    self.url,
                    additional_headers={"Authorization": f"Bearer {self._token}"},
                    open_timeout=OPEN_TIMEOUT,
                    close_timeout=CLOSE_TIMEOUT,
                    max_size=None,
                ) as ws:
                    await self._session(ws)
                if not self._exit.is_set():
                    self._log_close(ws)
            except _HelloRefused as exc:
                logger.warning(
                    "orbit worker %s: %s; reconnecting in %.1f s", self.worker_id, exc, self._reconnect_delay
                )
            except InvalidStatus as exc:
                status = exc.response.status_code
                if status in FATAL_HTTP_STATUSES:
                    raise APIError(FATAL_HTTP_STATUSES[status], status, f"handshake refused: HTTP {status}") from exc
                logger.warning("orbit worker %s: handshake refused (HTTP %s); retrying", self.worker_id, status)
            except (OSError, TimeoutError, WebSocketException, _NoAnswer) as exc:
                logger.warning("orbit worker %s: connection lost (%s); reconnecting", self.worker_id, exc or type(exc))
            self._check_finished()
            if self._exit.is_set():
                return
            # Reset only by a hello.ok: a server that accepts connections but refuses
            # hellos (UNAVAILABLE) is asked less and less often.
            delay = self._reconnect_delay
            self._reconnect_delay = min(delay * 2, self._max_reconnect_delay)
            try:
                await asyncio.wait_for(self._exit.wait(), timeout=delay)
            except TimeoutError:
                pass

    def _log_close(self, ws: ClientConnection) -> None:
        """Why the server closed, in its own words when it sent them (an error frame first)."""
        code = ws.close_code
        conn = self._closed_conn
        error = conn.last_error if conn is not None and conn.error_was_last else None
        said = ""
        if error is not None:
            said = f": {error.get('code')} {error.get('message')}"
        elif ws.close_reason:
            said = f": {ws.close_reason}"
        meaning = CLOSE_MEANINGS.get(code) if code is not None else None
        level = logging.ERROR if code == 1009 else logging.WARNING
        logger.log(
            level,
            "orbit worker %s: connection closed by the server (code %s%s)%s; reconnecting",
            self.worker_id,
            code,
            f", {meaning}" if meaning else "",
            said,
        )

    async def _session(self, ws: ClientConnection) -> None:
        self._generation += 1
        conn = _Connection(ws, self._generation)
        self._conn = self._closed_conn = conn
        reader = asyncio.create_task(self._read_loop(conn))
        try:
            try:
                reply = await self._raw_call(
                    conn,
                    {
                        "type": "hello",
                        "worker_id": self.worker_id,
                        "queues": self.queues,
                        "capacity": self.capacity,
                        "handlers": self._advertised,
                        "concurrency_keys": self.concurrency_keys,
                        "version": self.version,
                    },
                )
                if reply.get("type") != "hello.ok":
                    code, message = _error_code(reply), str(reply.get("message", ""))
                    if code in TRANSIENT_CODES:
                        # "Not now" (e.g. this worker_id is still in use by a live connection):
                        # the same hello can succeed later, so reconnect with backoff.
                        raise _HelloRefused(f"hello answered {code}: {message}")
                    raise _fatal(code, f"hello refused: {message}")
                self.session_id = reply.get("session_id") if isinstance(reply.get("session_id"), str) else None
                self._lease_seconds = _seconds(reply.get("lease_seconds"), DEFAULT_LEASE_SECONDS)
                self._renew_seconds = _seconds(reply.get("renew_seconds"), self._lease_seconds / 3)
                for known in self._attempts.values():  # assigned before this reply was handled
                    known.schedule_renewal(self._renew_seconds)
                self._renew_kick.set()
                held = reply.get("held")
                await self._reconcile(conn, held if isinstance(held, list) else [])
            except _NoAnswer:
                await asyncio.wait({reader}, timeout=CLOSE_TIMEOUT)
                if conn.fatal is not None:
                    raise conn.fatal from None
                raise
            conn.ready = True
            self._reconnect_delay = self._min_reconnect_delay
            self._ready.set()
            logger.info("orbit worker %s: connected (session %s)", self.worker_id, self.session_id)
            if self._draining:
                self._spawn(self._send_drain(conn))
            self._check_finished()
            exit_waiter = asyncio.create_task(self._exit.wait())
            try:
                await asyncio.wait({reader, exit_waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                exit_waiter.cancel()
            if conn.fatal is not None:
                raise conn.fatal
        finally:
            self._drop_connection(conn)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    def _drop_connection(self, conn: _Connection) -> None:
        conn.closed = True
        conn.ready = False
        if self._conn is conn:
            self._conn = None
            self._ready.clear()
        for future in conn.pending.values():
            if not future.done():
                future.set_exception(_NoAnswer("connection closed"))
        conn.pending.clear()

    async def _read_loop(self, conn: _Connection) -> None:
        try:
            async for message in conn.ws:
                self._dispatch(conn, message)
        except ConnectionClosed:
            pass
        finally:
            code = conn.ws.close_code
            if code in FATAL_CLOSE_CODES and conn.fatal is None:
                error = conn.last_error or {}
                said = error.get("message")
                message = said if isinstance(said, str) else f"closed with {code}"
                conn.fatal = _fatal(_error_code(error) if error else FATAL_CLOSE_CODES[code], message)
            self._drop_connection(conn)

    def _dispatch(self, conn: _Connection, message: str | bytes) -> None:
        try:
            frame = json.loads(message)
        except ValueError:
            logger.error("orbit worker %s: protocol error: frame is not JSON", self.worker_id)
            return
        if not isinstance(frame, dict):
            logger.error("orbit worker %s: protocol error: frame is not a JSON object", self.worker_id)
            return
        reply_to = frame.get("reply_to")
        conn.error_was_last = reply_to is None and frame.get("type") == "error"
        if reply_to is not None:
            future = conn.pending.pop(reply_to, None) if isinstance(reply_to, str) else None
            if future is not None and not future.done():
                future.set_result(frame)
            elif frame.get("type") == "error":
                logger.warning("orbit worker %s: error for request %r: %s", self.worker_id, reply_to, frame)
            return
        kind = frame.get("type")
        if kind == "task.assign":
            self._on_assign(conn, frame)
        elif kind == "error":
            conn.last_error = frame
            logger.warning(
                "orbit worker %s: server error: %s %s", self.worker_id, frame.get("code"), frame.get("message")
            )
        else:
            logger.debug("orbit worker %s: ignoring frame of type %r", self.worker_id, kind)

    async def _raw_call(self, conn: _Connection, frame: dict[str, Any]) -> dict[str, Any]:
        """Send a request on ``conn`` and wait for its reply (or raise _NoAnswer)."""
        if conn.closed:
            raise _NoAnswer("connection closed")
        request_id = str(next(self._ids))
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.pending[request_id] = future
        try:
            try:
                await conn.ws.send(json.dumps({**frame, "id": request_id}))
            except ConnectionClosed as exc:
                # Our own future first: nobody awaits it, and failing it would log
                # "Future exception was never retrieved".
                conn.pending.pop(request_id, None)
                self._drop_connection(conn)
                raise _NoAnswer("connection closed") from exc
            try:
                return await asyncio.wait_for(future, timeout=self._request_timeout)
            except TimeoutError as exc:
                raise _NoAnswer(f"no reply to {frame['type']} within {self._request_timeout}s") from exc
        finally:
            conn.pending.pop(request_id, None)

    async def _call(self, frame: dict[str, Any], unless: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Send once a connection is ready; ``unless`` is re-checked right before sending."""
        while True:
            await self._ready.wait()
            conn = self._conn
            if conn is not None and conn.ready:
                break
            await asyncio.sleep(0)
        if unless is not None and unless():
            raise _Abandoned
        return await self._raw_call(conn, frame)

    def _send_nowait(self, conn: _Connection, frame: dict[str, Any]) -> None:
        async def send() -> None:
            try:
                await conn.ws.send(json.dumps({**frame, "id": str(next(self._ids))}))
            except ConnectionClosed:
                pass

        self._spawn(send())

    def _spawn(self, coroutine: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("orbit worker %s: internal task failed", self.worker_id, exc_info=task.exception())

    # ------------------------------------------------------------------ assignments

    def _handler_for(self, task: TaskInfo) -> Handler | None:
        return self._exact.get((task.handler, task.handler_version)) or self._any_version.get(task.handler)

    def _on_assign(self, conn: _Connection, frame: dict[str, Any]) -> None:
        ids = _ids_of(frame)
        if ids is None:
            logger.error("orbit worker %s: protocol error: task.assign without attempt_id/epoch", self.worker_id)
            return
        attempt_id, epoch = ids
        self._send_nowait(conn, {"type": "task.assign.ack", "attempt_id": attempt_id})
        known = self._attempts.get(attempt_id)
        try:
            assignment = parse_assignment(frame, concurrency_keys=self.concurrency_keys)
        except ProtocolError as exc:
            if known is not None:
                self._conflict(known, f"protocol error: {exc}")
            else:
                self._reject(attempt_id, epoch, f"protocol error: {exc}")
            return
        if known is not None:
            problem = _changes(known.assignment, assignment)
            if problem is not None:
                self._conflict(known, f"protocol error: {problem}")
            else:
                known.generation = conn.generation  # a repeated delivery: same attempt, same token
            return
        if attempt_id in self._rejected:
            self._reject(attempt_id, epoch, self._rejected[attempt_id][1])
            return
        if self._draining or self._stopping:
            self._reject(attempt_id, epoch, "draining" if self._draining else "stopping")
            return
        handler = self._handler_for(assignment.task)
        if handler is None:
            self._reject(attempt_id, epoch, "no handler", hold=NO_HANDLER_HOLD_SECONDS)
            pair = (assignment.task.handler, assignment.task.handler_version)
            if pair not in self._unserved:
                self._unserved.add(pair)
                logger.warning(
                    "orbit worker %s: assigned %s %s, which it has no handler for (a bare handler name "
                    "advertises every handler); each such task is handed back after %.1f s",
                    self.worker_id,
                    *pair,
                    NO_HANDLER_HOLD_SECONDS,
                )
            return
        attempt = _Attempt(assignment, handler, conn.generation, self._renew_seconds)
        self._attempts[attempt_id] = attempt
        self._spawn(self._drive(attempt))

    def _reject(self, attempt_id: str, epoch: int, reason: str, hold: float = 0.0) -> None:
        """Hand an attempt back without running anything (after `hold` seconds)."""
        if reason.startswith("protocol error"):
            logger.error("orbit worker %s: %s; releasing attempt %s", self.worker_id, reason, attempt_id)
        else:
            logger.info("orbit worker %s: releasing attempt %s (%s)", self.worker_id, attempt_id, reason)
        self._rejected[attempt_id] = (epoch, reason)
        self._spawn(self._release(attempt_id, epoch, reason, hold))

    def _conflict(self, attempt: _Attempt, reason: str) -> None:
        """The server contradicts what it told us about an attempt we hold."""
        if attempt.phase == "leased":
            logger.error("orbit worker %s: %s; the handler will not run", self.worker_id, reason)
            if attempt.release_reason is None:
                attempt.release_reason = reason
            attempt.wake.set()
        else:
            # The handler already runs under the original assignment; keep it and say so.
            logger.error("orbit worker %s: %s; keeping the original assignment", self.worker_id, reason)

    def _lose(self, attempt: _Attempt, why: str) -> None:
        if attempt.lost:
            return
        logger.info("orbit worker %s: attempt %s lost (%s)", self.worker_id, attempt.id, why)
        attempt.lost = True
        attempt.wake.set()
        if attempt.execution is not None:
            attempt.execution._mark_lease_lost()

    async def _release(self, attempt_id: str, epoch: int, reason: str, hold: float = 0.0) -> None:
        if hold:
            await asyncio.sleep(hold)
        frame = {"type": "task.release", "attempt_id": attempt_id, "epoch": epoch, "reason": reason}
        try:
            reply = await self._call(frame)
        except _NoAnswer:
            return  # still in _rejected: released again if the next hello lists it as held
        if reply.get("type") != "task.release.ok":
            logger.warning("orbit worker %s: release of %s answered %s", self.worker_id, attempt_id, _error_code(reply))
        if self._rejected.get(attempt_id, (None,))[0] == epoch:
            del self._rejected[attempt_id]
        self._check_finished()

    async def _reconcile(self, conn: _Connection, held_entries: list[Any]) -> None:
        """After hello.ok: match the server's ``held`` list with what this process holds."""
        held: dict[str, Any] = {}
        for entry in held_entries:
            ids = _ids_of(entry)
            if ids is None:
                logger.error("orbit worker %s: protocol error: unreadable held entry %r", self.worker_id, entry)
                continue
            held[ids[0]] = entry
        for attempt_id in list(self._rejected):
            if attempt_id not in held:
                del self._rejected[attempt_id]  # the server no longer holds it: nothing to hand back
        for attempt in list(self._attempts.values()):
            if attempt.generation < conn.generation and attempt.id not in held:
                self._lose(attempt, "not held by the server after reconnect")

        to_resume: list[tuple[_Attempt | None, _Assignment]] = []
        for attempt_id, entry in held.items():
            epoch = entry["epoch"]
            if attempt_id in self._rejected:
                self._spawn(self._release(attempt_id, epoch, self._rejected[attempt_id][1]))
                continue
            known = self._attempts.get(attempt_id)
            if known is not None and known.generation >= conn.generation:
                continue
            try:
                assignment = parse_assignment(entry, concurrency_keys=self.concurrency_keys)
                problem = None if known is None else _changes(known.assignment, assignment)
            except ProtocolError as exc:
                problem = str(exc)
            if problem is not None:
                if known is not None:
                    self._conflict(known, f"protocol error: held entry: {problem}")
                else:
                    self._reject(attempt_id, epoch, f"protocol error: held entry: {problem}")
                continue
            to_resume.append((known, assignment))

        replies = await asyncio.gather(
            *(
                self._raw_call(conn, {"type": "task.resume", "attempt_id": a.attempt_id, "epoch": a.epoch})
                for _, a in to_resume
            )
        )
        for (known, expected), reply in zip(to_resume, replies, strict=True):
            if reply.get("type") != "task.resume.ok":
                if known is not None:
                    self._lose(known, f"resume answered {_error_code(reply)}")
                continue
            body = reply.get("assignment") if isinstance(reply.get("assignment"), dict) else reply
            try:
                confirmed = parse_assignment(body, concurrency_keys=self.concurrency_keys)
                problem = _changes(expected, confirmed)
            except ProtocolError as exc:
                problem = str(exc)
            if problem is not None:
                if known is not None:
                    self._conflict(known, f"protocol error: task.resume.ok: {problem}")
                else:
                    self._reject(expected.attempt_id, expected.epoch, f"protocol error: task.resume.ok: {problem}")
                continue
            if known is not None:
                known.generation = conn.generation
            elif (confirmed.state or expected.state) == "RUNNING":
                self._adopt_orphan(confirmed, conn.generation)
            else:
                self._reject(expected.attempt_id, expected.epoch, "not held by this worker process")

    def _adopt_orphan(self, assignment: _Assignment, generation: int) -> None:
        """A RUNNING attempt of an earlier process with this worker_id: its effect is unknown."""
        logger.warning(
            "orbit worker %s: attempt %s was running in an earlier process; reporting UNKNOWN",
            self.worker_id,
            assignment.attempt_id,
        )
        attempt = _Attempt(assignment, None, generation, self._renew_seconds)
        attempt.phase = "reporting"
        self._attempts[attempt.id] = attempt
        result = {
            "outcome": "UNKNOWN",
            "retryable": False,
            "error": {
                "type": "WorkerRestarted",
                "message": "attempt was running in an earlier process with this worker_id; effect unknown",
            },
        }
        self._spawn(self._finish(attempt, self._report(attempt, result)))

    # ------------------------------------------------------------------ one attempt

    async def _finish(self, attempt: _Attempt, work: Awaitable[None]) -> None:
        try:
            await work
        finally:
            if self._attempts.get(attempt.id) is attempt:
                del self._attempts[attempt.id]
            self._check_finished()

    async def _drive(self, attempt: _Attempt) -> None:
        async def work() -> None:
            if not await self._start(attempt):
                return
            attempt.phase = "reporting" if attempt.release_reason or attempt.lost else "running"
            if attempt.phase == "reporting":
                # Start was approved but the attempt must not run here (a protocol error, or the
                # lease went meanwhile): the handler never ran, so a retry is safe.
                why = attempt.release_reason or "lease lost before the handler started"
                result = {"outcome": "FAILED", "retryable": True, "error": {"type": "NotRun", "message": why}}
            else:
                result = await self._execute(attempt)
                attempt.phase = "reporting"
            await self._report(attempt, result)

        await self._finish(attempt, work())

    async def _start(self, attempt: _Attempt) -> bool:
        """Ask for Start until approved (True) or until the attempt is no longer ours (False)."""
        paused_since: float | None = None
        paused_delay = QUEUE_PAUSED_BACKOFF
        transient_delay = TRANSIENT_BACKOFF
        frame = {"type": "task.start", "attempt_id": attempt.id, "epoch": attempt.epoch}
        while True:
            if attempt.release_reason is not None:
                await self._hand_back(attempt, attempt.release_reason)
                return False
            if attempt.lost:
                return False
            if self._draining:
                await self._hand_back(attempt, "draining")
                return False
            try:
                reply = await self._call(
                    frame, unless=lambda: attempt.lost or attempt.release_reason is not None or self._draining
                )
            except (_NoAnswer, _Abandoned):
                continue
            if reply.get("type") == "task.start.ok":
                number = reply.get("attempt_number")
                attempt.attempt_number = number if isinstance(number, int) and not isinstance(number, bool) else 0
                try:
                    attempt.lease_expires_at = _opt_time(reply, "lease_expires_at", "task.start.ok")
                except ProtocolError:
                    attempt.lease_expires_at = None
                attempt.schedule_renewal(self._renew_seconds)
                return True
            code = _error_code(reply)
            if code != "QUEUE_PAUSED":
                paused_since, paused_delay = None, QUEUE_PAUSED_BACKOFF
            if code == "RATE_LIMITED":
                # Not approved, nothing recorded: ask again with the same attempt and epoch. The
                # renewer keeps the lease; the server answers LEASE_LOST once it cannot.
                wait_ms = reply.get("retry_after_ms")
                if isinstance(wait_ms, bool) or not isinstance(wait_ms, (int, float)) or wait_ms < 0:
                    wait = MISSING_RETRY_AFTER
                else:
                    wait = wait_ms / 1000
                await attempt.sleep(min(wait, self._lease_seconds))
            elif code == "QUEUE_PAUSED":
                # Short pauses (a configure flicker) should not churn attempts; a long pause should
                # not pin our capacity and the queue's permits: ask again with backoff for up to one
                # lease, renewing meanwhile, then hand the attempt back (no attempt is consumed).
                now = time.monotonic()
                paused_since = now if paused_since is None else paused_since
                if now - paused_since >= self._lease_seconds:
                    await self._hand_back(attempt, "queue paused")
                    return False
                await attempt.sleep(paused_delay)
                paused_delay = min(paused_delay * 2, self._renew_seconds)
            elif code in ("LEASE_LOST", "TASK_CANCELLED"):
                logger.info("orbit worker %s: start of %s refused: %s", self.worker_id, attempt.id, code)
                return False
            elif code in TRANSIENT_CODES:
                await attempt.sleep(transient_delay)
                transient_delay = min(transient_delay * 2, self._renew_seconds)
            else:
                logger.error("orbit worker %s: start of %s refused: %s %s", self.worker_id, attempt.id, code, reply)
                await self._hand_back(attempt, f"start refused: {code}")
                return False

    async def _hand_back(self, attempt: _Attempt, reason: str) -> None:
        if self._attempts.get(attempt.id) is attempt:
            del self._attempts[attempt.id]
        attempt.phase = "released"
        self._rejected[attempt.id] = (attempt.epoch, reason)
        await self._release(attempt.id, attempt.epoch, reason)

    async def _execute(self, attempt: _Attempt) -> dict[str, Any]:
        handler = attempt.handler
        assert handler is not None
        execution = Execution(self, attempt.assignment, attempt.attempt_number, attempt.lease_expires_at)
        attempt.execution = execution
        if attempt.cancel_requested:
            execution._mark_cancel_requested()
        try:
            if _is_async(handler):
                value = await handler(execution)
            else:
                value = await asyncio.to_thread(handler, execution)
                if inspect.isawaitable(value):
                    value = await value
        except RetryableError as exc:
            return _failure("FAILED", True, exc)
        except UnknownOutcome as exc:
            return _failure("UNKNOWN", False, exc)
        except CancelRequested as exc:  # the handler stopped as asked: expected, no traceback
            logger.info("orbit worker %s: handler for %s stopped: %s", self.worker_id, attempt.id, exc)
            return _failure("FAILED", False, exc)
        except Exception as exc:
            logger.warning("orbit worker %s: handler for %s raised", self.worker_id, attempt.id, exc_info=True)
            return _failure("FAILED", False, exc)
        if value is None:
            return {"outcome": "SUCCEEDED", "retryable": False}
        try:
            encoded = json.dumps(value, allow_nan=False)  # as it will be sent: ASCII-escaped
            if "\\ud" in encoded:
                # A surrogate escape (a pair for an emoji, or a lone one): UTF-8 refuses
                # a lone surrogate, as the server would.
                json.dumps(value, ensure_ascii=False).encode("utf-8")
            if len(encoded) > MAX_OUTPUT_BYTES:
                raise ValueError(f"{len(encoded)} bytes encoded, over the {MAX_OUTPUT_BYTES} byte limit")
            if _deeper_than(value, MAX_OUTPUT_DEPTH):
                raise ValueError(f"nested more than {MAX_OUTPUT_DEPTH} levels deep")
        except (TypeError, ValueError) as exc:
            # The handler finished (its effect happened) but the output cannot be reported: that
            # is an unknown outcome for the platform, not a failure that could be retried.
            return {
                "outcome": "UNKNOWN",
                "retryable": False,
                "error": {"type": "OutputNotSerializable", "message": f"handler output is not JSON: {exc}"},
            }
        return {"outcome": "SUCCEEDED", "retryable": False, "output": value}

    async def _report(self, attempt: _Attempt, result: dict[str, Any]) -> None:
        """Send the result until acknowledged; the same content every time."""
        frame = {"type": "task.result", "attempt_id": attempt.id, "epoch": attempt.epoch, **result}
        delay = TRANSIENT_BACKOFF
        while True:
            try:
                reply = await self._call(frame)
            except _NoAnswer:
                continue
            if reply.get("type") == "task.result.ok":
                logger.info(
                    "orbit worker %s: result for %s acknowledged (task_state=%s duplicate=%s late=%s)",
                    self.worker_id,
                    attempt.id,
                    reply.get("task_state"),
                    reply.get("duplicate"),
                    reply.get("late"),
                )
                return
            code = _error_code(reply)
            if code in TRANSIENT_CODES:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._renew_seconds)
                continue
            logger.error("orbit worker %s: result for %s refused: %s %s", self.worker_id, attempt.id, code, reply)
            return

    # ------------------------------------------------------------------ renewals

    async def _renew_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._renew_kick.wait(), timeout=min(RENEW_TICK_SECONDS, self._renew_seconds))
                self._renew_kick.clear()
            except TimeoutError:
                pass
            conn = self._conn
            if conn is None or not conn.ready:
                continue
            now = time.monotonic()
            for attempt in list(self._attempts.values()):
                if attempt.lost or attempt.renewing or attempt.generation != conn.generation:
                    continue
                if now < attempt.renew_due:
                    continue
                attempt.renewing = True
                self._spawn(self._renew(conn, attempt))

    async def _renew(self, conn: _Connection, attempt: _Attempt) -> None:
        try:
            reply = await self._raw_call(conn, {"type": "task.renew", "attempt_id": attempt.id, "epoch": attempt.epoch})
        except _NoAnswer:
            return
        finally:
            attempt.renewing = False
        if reply.get("type") == "task.renew.ok":
            try:
                expires = _opt_time(reply, "lease_expires_at", "task.renew.ok")
            except ProtocolError:
                expires = None
            if expires is not None:
                attempt.lease_expires_at = expires
                if attempt.execution is not None:
                    attempt.execution.lease_expires_at = expires
            attempt.schedule_renewal(self._renew_seconds)
            if reply.get("cancel_requested") is True and not attempt.cancel_requested:
                attempt.cancel_requested = True
                if attempt.execution is not None:
                    attempt.execution._mark_cancel_requested()
        elif _error_code(reply) == "LEASE_LOST":
            self._lose(attempt, "renew answered LEASE_LOST")
        else:
            logger.warning("orbit worker %s: renew of %s answered %s", self.worker_id, attempt.id, reply)

    # ------------------------------------------------------------------ drain / stop

    def _begin_drain(self) -> None:
        if self._draining:
            return
        logger.info("orbit worker %s: draining", self.worker_id)
        self._draining = True
        for attempt in self._attempts.values():
            if attempt.phase == "leased":
                attempt.wake.set()
        conn = self._conn
        if conn is not None and conn.ready:
            self._spawn(self._send_drain(conn))
        self._check_finished()

    async def _send_drain(self, conn: _Connection) -> None:
        try:
            reply = await self._raw_call(conn, {"type": "drain"})
        except _NoAnswer:
            if conn.closed:
                return  # sent again after the next hello
            reply = {"type": "error", "code": "NO_REPLY"}  # an open connection that ignores drain
        if reply.get("type") != "drain.ok":
            logger.warning("orbit worker %s: drain answered %s", self.worker_id, reply)
        conn.drain_acked = True
        self._check_finished()

    def _check_finished(self) -> None:
        if not self._draining or self._attempts or self._rejected:
            return
        conn = self._conn
        if conn is None or conn.drain_acked:
            self._exit.set()

    def _on_stop(self) -> None:
        logger.info("orbit worker %s: stopping", self.worker_id)
        self._stopping = True
        self._exit.set()

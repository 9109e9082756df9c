"""Runs ORM work for async code on a pool of threads that keep their connections.

Django's own helpers close connections around each call (CONN_MAX_AGE), which
would reconnect to MySQL for every protocol message. Here a connection lives as
long as its thread; after a connection error it is closed so the next call on
that thread reconnects (e.g. after a MariaDB restart)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection

from orbit import cells
from orbit.errors import Unavailable

T = TypeVar("T")

DB_THREADS: int = settings.ORBIT_DB_THREADS
# Every request of a server process (an HTTP request, a worker frame, a lease)
# is answered within this bound: past it, UNAVAILABLE, whatever the database
# does. A frozen (not dead) server never answers; a serving connection gives
# up on a statement sooner (orbit.db.mysql: SERVING_TIMEOUTS), so the
# transaction it was in is rolled back, never half kept.
REQUEST_DEADLINE_SECONDS = 4.5
DATABASE_TOO_SLOW = f"database did not answer within {REQUEST_DEADLINE_SECONDS:g} s; retry later"
_executor = ThreadPoolExecutor(max_workers=DB_THREADS, thread_name_prefix="orbit-db")
# With cells, each cell has a pool of its own: a stalled cell's calls hold
# only its own threads, never those another cell's requests wait for.
_cell_executors: dict[str, ThreadPoolExecutor] = {}
_cell_executors_lock = threading.Lock()


def _executor_of(cell: str | None) -> ThreadPoolExecutor:
    if cell is None:
        return _executor
    executor = _cell_executors.get(cell)
    if executor is None:
        with _cell_executors_lock:
            executor = _cell_executors.setdefault(
                cell, ThreadPoolExecutor(max_workers=DB_THREADS, thread_name_prefix=f"orbit-db-{cell}")
            )
    return executor


# MySQL client errors that mean this connection is gone (the server restarted, or the link
# broke), not that a statement failed: every other connection to that server made before
# it is likely gone too.
CONNECTION_LOST_ERRNOS = frozenset({2002, 2003, 2006, 2013, 2055, 4031})
# Per cell (None: the one database), how many times a connection to it was found gone;
# each thread notes the count its connection has seen (orbit.db.pool's threads and the
# round lanes' alike).
_losses: dict[str | None, int] = {}
_losses_lock = threading.Lock()
_seen = threading.local()


def call_guarded(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Runs `fn` on this thread's persistent connection, dropping the connection
    when the database failed under it, so the next call reconnects. A connection
    found gone on another thread since this one's last call is dropped first: a
    database restart then fails the one call that found it, not the first call of
    every thread and lane that still holds a connection from before it."""
    cell = cells.entered()
    losses = _losses.get(cell, 0)
    seen: dict[str | None, int] = _seen.__dict__.setdefault("losses", {})
    if seen.get(cell, losses) != losses and connection.connection is not None and not connection.in_atomic_block:
        connection.close()
    seen[cell] = losses
    try:
        return fn(*args, **kwargs)
    except (OperationalError, InterfaceError) as exc:
        if isinstance(exc, InterfaceError) or (exc.args and exc.args[0] in CONNECTION_LOST_ERRNOS):
            _lost(cell, seen)
        connection.close()
        raise
    finally:
        _discard_if_broken(cell, seen)


def _lost(cell: str | None, seen: dict[str | None, int]) -> None:
    with _losses_lock:
        _losses[cell] = _losses.get(cell, 0) + 1
        seen[cell] = _losses[cell]  # this thread's own connection is closed already


def _discard_if_broken(cell: str | None, seen: dict[str | None, int]) -> None:
    """An error `fn` handled itself (an API view answering 503 UNAVAILABLE) never reaches the
    except above, yet it may have broken this thread's connection: kept, it would answer
    "server has gone away" to every later call on this thread, long after the database is back.
    Django flags any database error; keep the connection only if it still answers a ping."""
    if connection.connection is None or not connection.errors_occurred or connection.in_atomic_block:
        return
    if connection.is_usable():
        connection.errors_occurred = False
    else:
        connection.close()
        _lost(cell, seen)


async def run_db(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn` on a pool thread, awaited within the request deadline (UNAVAILABLE
    past it; a call not started yet is then skipped). It runs on the pool of
    the cell the caller entered (orbit.cells), in a copy of the caller's
    context: that cell is entered there too, and a cell `fn` enters stays
    with this call, not the thread."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, call_guarded, fn, *args, **kwargs)
    return await within_deadline(loop.run_in_executor(_executor_of(cells.entered()), call))


def in_every_cell(fn: Callable[[], T], seconds: float) -> dict[str, T | BaseException]:
    """With cells: `fn` in each cell at once, each on its cell's pool, for a
    caller that reads every cell (a /metrics scrape): each cell's outcome (a
    value or what it raised), UNAVAILABLE for a cell that did not answer
    within `seconds` (its call is skipped if not started yet, else left to
    its connection's timeouts), so a stalled cell delays the caller by
    `seconds` at most. Inline (tests sharing their transaction), one after
    another on the caller's connection."""
    from orbit.db import inline

    if inline():
        outcomes: dict[str, T | BaseException] = {}
        for cell in cells.names():
            with cells.in_cell(cell):
                try:
                    outcomes[cell] = fn()
                except Exception as exc:  # noqa: BLE001 - the cell's outcome, for the caller to judge
                    outcomes[cell] = exc
        return outcomes

    def in_cell(cell: str) -> T:
        cells.enter(cell)
        return call_guarded(fn)

    calls: dict[str, Future[T]] = {
        cell: _executor_of(cell).submit(contextvars.copy_context().run, in_cell, cell) for cell in cells.names()
    }
    wait(calls.values(), timeout=seconds)
    answered: dict[str, T | BaseException] = {}
    for cell, call in calls.items():
        if not call.done():
            call.cancel()
            answered[cell] = Unavailable(DATABASE_TOO_SLOW)
        else:
            failure = call.exception()
            answered[cell] = call.result() if failure is None else failure
    return answered


async def within_deadline(waiter: asyncio.Future[T]) -> T:
    """The outcome, or UNAVAILABLE once the request deadline passed (the
    waiter is cancelled: an item not yet claimed is skipped)."""
    (outcome,) = await each_within_deadline([waiter])
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


async def each_within_deadline(waiters: list[asyncio.Future[T]]) -> list[T | BaseException]:
    """Each waiter's outcome or the exception that ended it, in order; those
    still pending when the request deadline passes are cancelled and end in
    UNAVAILABLE. A cancelled caller cancels every waiter.

    Awaited directly and in turn, with one timer that cancels what is still
    pending: asyncio.wait_for would wrap each in a second future, and
    asyncio.gather add a task per waiter, more turns of the event loop (which
    every request and frame shares) between the outcomes and their caller."""
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = any([waiter.cancel() for waiter in waiters])  # every one, not up to the first

    timer = asyncio.get_running_loop().call_later(REQUEST_DEADLINE_SECONDS, expire)
    outcomes: list[T | BaseException] = []
    try:
        for waiter in waiters:
            try:
                outcomes.append(await waiter)
            except asyncio.CancelledError:
                if not expired:
                    raise  # the caller itself was cancelled
                outcomes.append(Unavailable(DATABASE_TOO_SLOW))
            except Exception as error:
                outcomes.append(error)
    except asyncio.CancelledError:
        for waiter in waiters:
            waiter.cancel()
        raise
    finally:
        timer.cancel()
    return outcomes

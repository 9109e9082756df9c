"""Runs ORM work for async code on a pool of threads that keep their connections.

Django's own helpers close connections around each call (CONN_MAX_AGE), which
would reconnect to MySQL for every protocol message. Here a connection lives as
long as its thread; after a connection error it is closed so the next call on
that thread reconnects (e.g. after a MariaDB restart)."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from django.db import InterfaceError, OperationalError, connection

T = TypeVar("T")

DB_THREADS = int(os.environ.get("ORBIT_DB_THREADS", "8"))
# Every request of a server process (an HTTP request, a worker frame, a lease)
# is answered within this bound: past it, UNAVAILABLE, whatever the database
# does. A frozen (not dead) server never answers; a serving connection gives
# up on a statement sooner (orbit.db.mysql: SERVING_TIMEOUTS), so the
# transaction it was in is rolled back, never half kept.
REQUEST_DEADLINE_SECONDS = 4.5
DATABASE_TOO_SLOW = f"database did not answer within {REQUEST_DEADLINE_SECONDS:g} s; retry later"
_executor = ThreadPoolExecutor(max_workers=DB_THREADS, thread_name_prefix="orbit-db")


def call_guarded(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Runs `fn` on this thread's persistent connection, dropping the connection
    when the database failed under it, so the next call reconnects."""
    try:
        return fn(*args, **kwargs)
    except (OperationalError, InterfaceError):
        connection.close()
        raise
    finally:
        _discard_if_broken()


def _discard_if_broken() -> None:
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


async def run_db(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor, functools.partial(call_guarded, fn, *args, **kwargs))

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
_executor = ThreadPoolExecutor(max_workers=DB_THREADS, thread_name_prefix="orbit-db")


def _call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return fn(*args, **kwargs)
    except (OperationalError, InterfaceError):
        connection.close()
        raise


async def run_db(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor, functools.partial(_call, fn, *args, **kwargs))

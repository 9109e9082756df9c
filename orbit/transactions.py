"""The one way to open an outermost transaction (docs/architecture/locking.md).

`@outermost` makes a function a transaction of its own: durable (it never
runs inside another transaction, so its commit is its effect's), its events
gathered and written at its end (the namespace's event sequence is the last
row it locks, orbit.audit), and run again whole after an InnoDB deadlock or
lock-wait timeout, which rolled it back entirely. `sent_together=True`: its
writes ride on its next statement and its COMMIT on its last writes
(orbit.db.rows.atomic_sent_together), as a round's do."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar, overload

from django.db import OperationalError, transaction

from orbit.audit import gathered_events
from orbit.db.rows import atomic_sent_together

P = ParamSpec("P")
T = TypeVar("T")

# InnoDB deadlock and lock-wait timeout: the transaction was rolled back whole,
# so running it again is safe.
RETRYABLE_MYSQL_ERRNOS = frozenset({1213, 1205})
TRANSACTION_RETRIES = 5


def is_retryable(exc: OperationalError) -> bool:
    return bool(exc.args) and exc.args[0] in RETRYABLE_MYSQL_ERRNOS


def run_retrying(work: Callable[[], T]) -> T:
    """Runs a whole transaction again after an InnoDB deadlock or lock timeout."""
    for attempt in range(TRANSACTION_RETRIES):
        try:
            return work()
        except OperationalError as exc:
            if not is_retryable(exc) or attempt == TRANSACTION_RETRIES - 1:
                raise
            time.sleep(0.005 * (attempt + 1))
    raise AssertionError("unreachable")


@overload
def outermost(fn: Callable[P, T], /) -> Callable[P, T]: ...
@overload
def outermost(*, sent_together: bool) -> Callable[[Callable[P, T]], Callable[P, T]]: ...


def outermost(
    fn: Callable[P, T] | None = None, /, *, sent_together: bool = False
) -> Callable[P, T] | Callable[[Callable[P, T]], Callable[P, T]]:
    def decorate(fn: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> T:
            def once() -> T:
                opened = atomic_sent_together() if sent_together else transaction.atomic(durable=True)
                with opened, gathered_events():
                    return fn(*args, **kwargs)

            return run_retrying(once)

        return run

    return decorate if fn is None else decorate(fn)

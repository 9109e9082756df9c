"""Lease recovery, deadline sweeps, plan triggers, the key policy
reconciles a crash cut short and the settlement of wide fan-outs, run by
every server process.

Every node may run this at once: candidates are read without locks and each
transition re-checks under the global lock order.

A database that is unreachable fails every sweep until it is back: the
outage is logged once as it starts and once as it ends, with how long it
lasted and how many sweeps failed (`SweepOutage`), not a traceback per sweep.
Any other failure is a fault: its traceback is logged each time."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from django.conf import settings
from django.db import close_old_connections, connection

from orbit import cells
from orbit.api.errors import translate
from orbit.errors import Unavailable
from plans.actions import fire_due_plans
from tasks.actions.dependencies import nudged, run_follow_ups
from tasks.actions.endings import recover_expired_leases, sweep_deadlines
from tasks.actions.permits import settle
from tasks.actions.policies import catch_up_policies

logger = logging.getLogger("orbit.maintenance")

# Seconds between sweeps; a lease is recovered at most this long after expiry.
SWEEP_INTERVAL_SECONDS = 0.5

_started = threading.Event()


def run_sweep() -> int:
    """Every part of a sweep, each whatever another's fault: a part that
    raises is reported after the others ran, unless the database is
    unreachable (then the rest would only wait on it too)."""
    parts: tuple[Callable[[], int], ...] = (
        recover_expired_leases,
        sweep_deadlines,
        fire_due_plans,
        catch_up_policies,
        lambda: run_follow_ups(settle),
    )
    done, fault = 0, None
    for part in parts:
        try:
            done += part()
        except Exception as exc:
            if database_unreachable(exc):
                raise
            fault = fault or exc
    if fault is not None:
        raise fault
    return done


def database_unreachable(exc: BaseException) -> bool:
    """The database is not there right now (orbit.api.errors.translate, as a
    request's 503 UNAVAILABLE), as opposed to a fault of the sweep."""
    return isinstance(translate(exc), Unavailable)


class SweepOutage:
    """How the sweeps fare while the database is unreachable, told in two lines."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, cell: str | None = None) -> None:
        self.clock = clock
        self.started: float | None = None
        self.failed_sweeps = 0
        self.sweeps = "maintenance sweeps" if cell is None else f"maintenance sweeps of cell {cell}"

    def sweep_failed(self, exc: Exception) -> None:
        if self.started is not None:
            self.failed_sweeps += 1
        if not database_unreachable(exc):
            logger.warning("maintenance sweep failed", exc_info=exc)
            return
        if self.started is None:
            self.started, self.failed_sweeps = self.clock(), 1
            # One line: the cause is the database's, a traceback says nothing more.
            logger.warning(
                "%s failing: the database is unreachable (%s: %s); retrying every %g s",
                self.sweeps,
                type(exc).__name__,
                exc,
                SWEEP_INTERVAL_SECONDS,
            )

    def sweep_succeeded(self) -> None:
        if self.started is None:
            return
        lasted = self.clock() - self.started
        logger.warning(
            "%s work again: the database was unreachable for %.1f s, %d %s failed",
            self.sweeps,
            lasted,
            self.failed_sweeps,
            "sweep" if self.failed_sweeps == 1 else "sweeps",
        )
        self.started, self.failed_sweeps = None, 0


def maintenance_loop(stop: threading.Event, cell: str | None = None) -> None:
    """Sweeps until `stop`; with cells, the one cell `cell` (each cell has a
    thread of its own, so a stalled cell delays no other's sweeps)."""
    cells.enter(cell)
    outage = SweepOutage(cell=cell)
    while not stop.is_set():
        try:
            run_sweep()
        except Exception as exc:  # the database may be down; keep trying
            outage.sweep_failed(exc)
            connection.close()
        else:
            outage.sweep_succeeded()
        finally:
            close_old_connections()
        # A wide fan-out's settlement left to do comes back at once, not a sweep later.
        nudged().wait(SWEEP_INTERVAL_SECONDS)


def start_background_maintenance() -> None:
    """Starts the sweep thread once per process (ORBIT_MAINTENANCE=0 turns it
    off, e.g. in tests that import the ASGI app in-process)."""
    if _started.is_set() or not settings.ORBIT_MAINTENANCE:
        return
    _started.set()
    for cell in cells.each():
        name = "orbit-maintenance" if cell is None else f"orbit-maintenance-{cell}"
        threading.Thread(target=maintenance_loop, args=(threading.Event(), cell), name=name, daemon=True).start()

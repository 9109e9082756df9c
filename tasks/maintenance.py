"""Lease recovery, deadline sweeps and plan triggers, run by every server process.

Every node may run this at once: candidates are read without locks and each
transition re-checks under the global lock order."""

from __future__ import annotations

import logging
import os
import threading

from django.db import close_old_connections, connection

from plans.actions import fire_due_plans
from tasks.actions.endings import recover_expired_leases, sweep_deadlines

logger = logging.getLogger("orbit.maintenance")

# Seconds between sweeps; a lease is recovered at most this long after expiry.
SWEEP_INTERVAL_SECONDS = 0.5

_started = threading.Event()


def run_sweep() -> int:
    return recover_expired_leases() + sweep_deadlines() + fire_due_plans()


def maintenance_loop(stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            run_sweep()
        except Exception:  # the database may be down; keep trying
            logger.warning("maintenance sweep failed", exc_info=True)
            connection.close()
        finally:
            close_old_connections()
        stop.wait(SWEEP_INTERVAL_SECONDS)


def start_background_maintenance() -> None:
    """Starts the sweep thread once per process (ORBIT_MAINTENANCE=0 turns it
    off, e.g. in tests that import the ASGI app in-process)."""
    if _started.is_set() or os.environ.get("ORBIT_MAINTENANCE", "1") == "0":
        return
    _started.set()
    thread = threading.Thread(target=maintenance_loop, args=(threading.Event(),), name="orbit-maintenance", daemon=True)
    thread.start()

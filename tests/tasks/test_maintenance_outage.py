"""The maintenance loop while the database is unreachable: one line as the
outage starts, one as it ends (how long, how many sweeps failed), and no
traceback per sweep; a fault that is not the database's keeps its traceback."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable

import pytest

from orbit import cells
from server.probes import open_connection
from tasks import maintenance
from tests.product.conftest import closed_port, mysql_settings

pytestmark = pytest.mark.django_db(transaction=True)

OUTAGE_SWEEPS = 10


def sweeps() -> str:
    """How the loop's lines name its sweeps: with cells, the cell's."""
    cell = cells.entered()
    return "maintenance sweeps" if cell is None else f"maintenance sweeps of cell {cell}"


def unreachable_database() -> int:
    """What a sweep meets while MySQL is gone: the driver's own "Can't connect", from a port nobody listens on."""
    open_connection(mysql_settings(closed_port()), 1).ensure_connection()
    raise AssertionError("a closed port answered")


def a_fault() -> int:
    raise ValueError("a bug in a sweep")


def run_loop(script: list[Callable[[], int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """maintenance_loop, its sweeps those of `script` in turn; it stops after the last."""
    stop = threading.Event()
    steps = iter(script)

    def sweep() -> int:
        step = next(steps, None)
        if step is None:
            stop.set()
            return 0
        return step()

    monkeypatch.setattr(maintenance, "run_sweep", sweep)
    monkeypatch.setattr(maintenance, "SWEEP_INTERVAL_SECONDS", 0.01)
    # With cells, a loop sweeps one cell: the test's own.
    thread = threading.Thread(target=maintenance.maintenance_loop, args=(stop, cells.entered()))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_an_outage_is_logged_once_as_it_starts_and_once_as_it_ends(caplog, monkeypatch):
    real = maintenance.run_sweep  # the real sweeps run between, on the loop's own connection
    script = [real, real, *[unreachable_database] * OUTAGE_SWEEPS, real, real]
    with caplog.at_level(logging.WARNING, logger="orbit.maintenance"):
        run_loop(script, monkeypatch)

    records = [r for r in caplog.records if r.name == "orbit.maintenance"]
    assert len(records) == 2, [r.getMessage() for r in records]
    started, ended = records
    assert started.levelno == logging.WARNING and started.exc_info is None
    assert started.getMessage().startswith(f"{sweeps()} failing: the database is unreachable (OperationalError")
    assert "Can't connect" in started.getMessage() and "\n" not in started.getMessage()
    assert ended.levelno == logging.WARNING and ended.exc_info is None
    lasted = re.fullmatch(
        rf"{sweeps()} work again: the database was unreachable for (\d+\.\d) s, {OUTAGE_SWEEPS} sweeps failed",
        ended.getMessage(),
    )
    assert lasted, ended.getMessage()
    assert "Traceback" not in caplog.text


def test_a_second_outage_is_told_again_and_a_fault_keeps_its_traceback(caplog, monkeypatch):
    script = [unreachable_database, maintenance.run_sweep, a_fault, unreachable_database, unreachable_database]
    with caplog.at_level(logging.WARNING, logger="orbit.maintenance"):
        run_loop(script, monkeypatch)  # the loop's last sweep, after the script, succeeds

    messages = [r.getMessage() for r in caplog.records if r.name == "orbit.maintenance"]
    assert [m.split(":")[0] for m in messages] == [
        f"{sweeps()} failing",
        f"{sweeps()} work again",
        "maintenance sweep failed",
        f"{sweeps()} failing",
        f"{sweeps()} work again",
    ], messages
    assert messages[1].endswith(", 1 sweep failed") and messages[4].endswith(", 2 sweeps failed")
    (fault,) = [r for r in caplog.records if r.getMessage() == "maintenance sweep failed"]
    assert fault.exc_info is not None and fault.exc_info[0] is ValueError
    assert caplog.text.count("Traceback") == 1

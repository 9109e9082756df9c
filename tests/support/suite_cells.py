"""The whole suite on two cells (`ORBIT_TEST_CELLS=1 scripts/test`, SPEC §14).

With ORBIT_CELLS set, the tests run as they do on one database, with their
tenants spread across the cells: each test that uses the database enters
one cell for its whole run (every other test the next cell, in collection
order), and the applications it makes are placed there, in the directory
first, as every application is under cells (tests/support/factories.py).
Every database is wrapped in the test's transaction (or flushed after a
transactional test): the directory and each cell."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from orbit import cells

# The fixtures through which pytest-django gives a test the database.
DATABASE_FIXTURES = ("db", "transactional_db", "django_db_reset_sequences", "django_db_serialized_rollback")

_cell_of_test: dict[str, str] = {}


def uses_database(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    return item.get_closest_marker("django_db") is not None or any(name in names for name in DATABASE_FIXTURES)


def spread_over_cells(items: list[pytest.Item]) -> None:
    """Every database test gets every database (pytest-django creates the
    test databases of the aliases its tests name) and a cell of its own."""
    if not cells.configured():
        return
    threads_of_tests_in_their_cell()
    names = cells.names()
    chosen = 0
    for item in items:
        if not uses_database(item):
            continue
        marker = item.get_closest_marker("django_db")
        kwargs = dict(marker.kwargs) if marker is not None else {}
        # django_db(transaction, reset_sequences, databases, ...): keep what the test asked for.
        for name, value in zip(("transaction", "reset_sequences"), marker.args if marker else (), strict=False):
            kwargs.setdefault(name, value)
        kwargs["databases"] = "__all__"
        item.add_marker(pytest.mark.django_db(**kwargs), append=False)  # the closest, before its own
        _cell_of_test[item.nodeid] = names[chosen % len(names)]
        chosen += 1


@pytest.fixture(autouse=True)
def _in_the_tests_cell(request: pytest.FixtureRequest) -> Iterator[None]:
    """Enters the test's cell once its database is set up (the transactions
    open on every alias first: entered, the default alias is the cell's)."""
    cell = _cell_of_test.get(request.node.nodeid)
    if cell is None:
        yield
        return
    request.getfixturevalue("_django_db_helper")
    with cells.in_cell(cell):
        yield


def without_cell(problems: list[str]) -> list[str]:
    """orbit_check's lines with the cell each was found in taken off: with
    cells, every line begins with the test's own cell ("cell a: …")."""
    cell = cells.entered()
    if cell is None:
        return problems
    prefix = f"cell {cell}: "
    assert all(problem.startswith(prefix) for problem in problems), problems
    return [problem.removeprefix(prefix) for problem in problems]


def show_the_tests_cell(get: Callable[[str], Any]) -> None:
    """With cells: the console shows one cell at a time, the operator's pick
    (kept in the session): picks the test's cell through `get` (a test
    client's get, a browser page's goto), as an operator picks it."""
    cell = cells.entered()
    if cell is not None:
        get(f"/admin/?cell={cell}")


def threads_of_tests_in_their_cell() -> None:
    """A thread the tests start (a client, a racing worker) works in the cell
    of the test that started it, as Python 3.14's threads inheriting their
    context would: a new thread starts with no cell entered. Only the tests'
    own threads (their target defined in tests/): the server's threads
    enter their cells themselves, and must go on doing so."""
    if not cells.configured() or getattr(threading.Thread.start, "in_starters_cell", False):
        return
    start = threading.Thread.start

    def start_in_starters_cell(thread: threading.Thread) -> None:
        target = getattr(thread, "_target", None)
        if target is not None and getattr(target, "__module__", "").startswith("tests."):
            cell = cells.entered()
            thread._target = functools.partial(_in_cell, cell, target)  # type: ignore[attr-defined]
        start(thread)

    start_in_starters_cell.in_starters_cell = True  # type: ignore[attr-defined]
    threading.Thread.start = start_in_starters_cell  # type: ignore[method-assign]


def _in_cell(cell: str | None, target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with cells.in_cell(cell):
        return target(*args, **kwargs)

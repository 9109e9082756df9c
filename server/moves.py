"""Moving an application between cells (`orbit_move_application`).

The directory row of the application (CellPlacement) records how far a move
got, so a move that crashed is finished by running it again:

- draining: intake is stopped. The source cell's application row says
  `moving`; rounds refuse its submits and leases and authentication refuses
  its requests, all with 503 and Retry-After, while its running attempts
  still report. The move waits until none is active (or its deadline: then
  it is called off and nothing has moved) and until every request admitted
  before the stop is past the request deadline.
- copy and switch: under the application's counter row, locked in the source
  (every writer of an application locks it first, so nothing of the
  application changes while it is held), every row of the application is
  copied in one transaction of the target cell (after removing any copy an
  earlier run left), then the directory names the target (phase copied).
  Rows are copied as the database holds them: key rows keep their token
  sequences, which continue above their highest value in the new cell.
- copied: the source's rows are removed in one transaction, and the
  directory forgets the move.

A node that still routes the application to the source (its directory cache
is per process) finds the application moving or gone there, answers 503 with
Retry-After, and reads the directory again for the retry."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from django.apps import apps
from django.db import DatabaseError, connections, models, transaction

from orbit import cells
from orbit.db.pool import REQUEST_DEADLINE_SECONDS
from orbit.db.rows import lock_by_pk
from orbit.models import Application, ApplicationState, CellPlacement, Namespace
from server.probes import installation_databases, one_database_twice

APPS = ("orbit", "queues", "tasks", "workers", "plans")
DRAINING, COPIED = "draining", "copied"
# Past the request deadline, a request admitted before intake stopped has ended.
SETTLE_SECONDS = REQUEST_DEADLINE_SECONDS + 1
BATCH = 1000


class MoveRefused(Exception):
    """The move cannot go on; the message says why (nothing is left half done)."""


@dataclass
class Owned:
    """The ids that say which rows of a cell are the application's."""

    application_id: str
    namespace_ids: list[str] = field(default_factory=list)
    queue_ids: list[str] = field(default_factory=list)
    plan_ids: list[str] = field(default_factory=list)

    def read(self) -> Owned:
        """From the cell entered."""
        from plans.models import Plan
        from queues.models import Queue

        self.namespace_ids = list(
            Namespace.objects.filter(application_id=self.application_id).values_list("id", flat=True)
        )
        self.queue_ids = list(Queue.objects.filter(namespace_id__in=self.namespace_ids).values_list("id", flat=True))
        self.plan_ids = list(Plan.objects.filter(namespace_id__in=self.namespace_ids).values_list("id", flat=True))
        return self

    def where(self, model: type[models.Model]) -> tuple[str, list[str]]:
        """The model's column that names the application's rows, and its values."""
        columns = {f.attname: str(f.column) for f in model._meta.concrete_fields}
        if model is Application:
            return columns["id"], [self.application_id]
        for attname, values in (
            ("application_id", [self.application_id]),
            ("namespace_id", self.namespace_ids),
            ("queue_id", self.queue_ids),
            ("plan_id", self.plan_ids),
        ):
            if attname in columns:
                return columns[attname], values
        raise AssertionError(f"{model._meta.db_table}: no column names its application")


def application_tables() -> list[type[models.Model]]:
    """Every model a cell holds for its applications."""
    return [
        model
        for model in apps.get_models()
        if model._meta.app_label in APPS and model._meta.model_name not in cells.DIRECTORY_MODELS
    ]


def _quoted(name: str) -> str:
    return f"`{name}`"


def _copy_table(model: type[models.Model], owned: Owned, source: str, target: str) -> int:
    """The application's rows of one table, from the source cell to the
    target, as stored (an auto-increment id is the target's own: no other row
    names one, and rows keep their order)."""
    column, values = owned.where(model)
    if not values:
        return 0
    pk = model._meta.pk
    assert pk is not None
    pk_column = str(pk.column)
    skip = pk_column if isinstance(pk, models.AutoField) else None
    names = [str(f.column) for f in model._meta.concrete_fields if f.column != skip and not f.generated]
    table = _quoted(model._meta.db_table)
    listed = ", ".join(_quoted(name) for name in names)
    holes = ", ".join(["%s"] * len(values))
    copied = 0
    with connections[cells.alias_of(source)].cursor() as reading:
        reading.execute(
            f"SELECT {listed} FROM {table} WHERE {_quoted(column)} IN ({holes}) ORDER BY {_quoted(pk_column)}",  # noqa: S608
            values,
        )
        with connections[cells.alias_of(target)].cursor() as writing:
            while rows := reading.fetchmany(BATCH):
                row_holes = "(" + ", ".join(["%s"] * len(names)) + ")"
                writing.execute(
                    f"INSERT INTO {table} ({listed}) VALUES {', '.join([row_holes] * len(rows))}",  # noqa: S608
                    [value for row in rows for value in row],
                )
                copied += len(rows)
    return copied


def _remove(model: type[models.Model], owned: Owned, alias: str) -> int:
    column, values = owned.where(model)
    if not values:
        return 0
    holes = ", ".join(["%s"] * len(values))
    with connections[alias].cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {_quoted(model._meta.db_table)} WHERE {_quoted(column)} IN ({holes})",  # noqa: S608
            values,
        )
        return cursor.rowcount


def placement_of(application: str) -> CellPlacement:
    found = CellPlacement.objects.filter(application_id=application).first()
    found = found or CellPlacement.objects.filter(name=application).first()
    if found is None:
        raise MoveRefused(f"no application {application!r} (an id or a name) in the directory")
    return found


def move_application(
    application: str,
    target: str,
    *,
    timeout: float,
    say: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
) -> None:
    if not cells.configured():
        raise MoveRefused("ORBIT_CELLS is not set: there is one cell, nowhere to move to")
    if target not in cells.names():
        raise MoveRefused(f"--to: unknown cell {target!r}; cells: {', '.join(cells.names())}")
    # Two names of one database: the move would remove the rows it had just copied.
    aliased = one_database_twice(installation_databases())
    if aliased is not None:
        raise MoveRefused(aliased)
    with _only_move_of(placement_of(application)):
        _move(placement_of(application), target, timeout=timeout, say=say, clock=clock)


@contextmanager
def _only_move_of(placement: CellPlacement) -> Iterator[None]:
    """Held for a whole move: a second run of it, which would read the same phase and copy
    again what the first had switched and removed, is refused instead. A named lock of the
    directory's server, so a run that crashed (its connection gone) leaves none behind."""
    directory = connections[cells.DIRECTORY]
    if directory.vendor != "mysql":  # cells are MySQL's; a test's SQLite directory has one process
        yield
        return
    name = f"orbit_move:{placement.application_id}"
    with directory.cursor() as cursor:
        cursor.execute("SELECT GET_LOCK(%s, 0)", [name])
        (held,) = cursor.fetchone()
    if held != 1:
        raise MoveRefused(
            f"a move of {placement.name} is running in another process; run it again once that one has ended"
        )
    try:
        yield
    finally:
        with directory.cursor() as cursor:
            cursor.execute("SELECT RELEASE_LOCK(%s)", [name])


def _move(
    placement: CellPlacement,
    target: str,
    *,
    timeout: float,
    say: Callable[[str], None],
    clock: Callable[[], float],
) -> None:
    """The move, under _only_move_of: the placement read again once it is held."""
    app_id = placement.application_id
    if placement.move_phase == "":
        if placement.cell == target:
            say(f"{placement.name} is in cell {target} already; nothing to move")
            return
        placement.moving_to, placement.move_phase = target, DRAINING
        placement.save(update_fields=["moving_to", "move_phase", "updated_at"])
    elif placement.move_phase == DRAINING and placement.moving_to != target:
        raise MoveRefused(f"a move of {placement.name} to cell {placement.moving_to} is under way; finish it first")
    elif placement.move_phase == COPIED and placement.cell != target:
        raise MoveRefused(
            f"{placement.name} has moved to cell {placement.cell}; run the move again with --to {placement.cell}"
        )
    if placement.move_phase == DRAINING:
        try:
            # A target that does not answer is found before intake stops, and one that fails
            # during the copy leaves the application served where it is.
            connections[cells.alias_of(target)].ensure_connection()
            _drain_copy_and_switch(placement, timeout=timeout, say=say, clock=clock)
        except DatabaseError:
            if placement.move_phase == DRAINING:
                _call_off(placement)
                say(
                    f"{placement.name}: cell {target} failed; the move is called off and intake resumed (nothing moved)"
                )
            raise
    source = placement.moving_from
    with cells.in_cell(source):
        owned = Owned(app_id).read()
        with transaction.atomic():
            removed = sum(_remove(model, owned, cells.alias_of(source)) for model in application_tables())
    placement.moving_from, placement.move_phase = "", ""
    placement.save(update_fields=["moving_from", "move_phase", "updated_at"])
    cells.forget(app_id)
    say(f"{placement.name}: {removed} rows removed from cell {source}; now served from cell {placement.cell}")


def _call_off(placement: CellPlacement) -> None:
    """Intake resumes in the source cell, and the directory forgets the move."""
    with cells.in_cell(placement.cell):
        Application.objects.filter(id=placement.application_id).update(moving=False)
    placement.moving_to, placement.move_phase = "", ""
    placement.save(update_fields=["moving_to", "move_phase", "updated_at"])


def _drain_copy_and_switch(
    placement: CellPlacement, *, timeout: float, say: Callable[[str], None], clock: Callable[[], float]
) -> None:
    source, target, app_id = placement.cell, placement.moving_to, placement.application_id
    with cells.in_cell(source):
        with transaction.atomic():
            lock_by_pk(ApplicationState, [app_id])
            Application.objects.filter(id=app_id).update(moving=True)
        stopped = clock()
        say(f"{placement.name}: intake stopped in cell {source}; waiting for its running attempts to end")
        # The timeout counts once every request admitted before the stop has ended.
        deadline = stopped + SETTLE_SECONDS + timeout
        while True:
            active = ApplicationState.objects.filter(application_id=app_id).values_list("active_attempts", flat=True)
            if not any(active) and clock() - stopped >= SETTLE_SECONDS:
                break
            if clock() >= deadline:
                _call_off(placement)
                raise MoveRefused(
                    f"{placement.name}: {sum(active)} attempts still active after {timeout:g} s;"
                    " the move is called off and intake resumed (nothing moved)"
                )
            time.sleep(0.2)
        with transaction.atomic():
            # Held until the switch: every writer of the application locks this row first.
            lock_by_pk(ApplicationState, [app_id])
            owned = Owned(app_id).read()
            with transaction.atomic(using=cells.alias_of(target)):
                for model in application_tables():  # a copy an earlier, interrupted run committed
                    _remove(model, owned, cells.alias_of(target))
                copied = {
                    model._meta.db_table: _copy_table(model, owned, source, target) for model in application_tables()
                }
                with cells.in_cell(target):
                    Application.objects.filter(id=app_id).update(moving=False)
            placement.cell, placement.moving_from, placement.moving_to, placement.move_phase = (
                target,
                source,
                "",
                COPIED,
            )
            placement.save(update_fields=["cell", "moving_from", "moving_to", "move_phase", "updated_at"])
    cells.forget(app_id)
    tables = ", ".join(f"{table} {count}" for table, count in sorted(copied.items()) if count)
    say(f"{placement.name}: copied to cell {target} ({tables}); the directory names cell {target}")

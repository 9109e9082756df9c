"""`manage.py orbit_prune --finished-before DURATION [--dry-run]`: opt-in retention.

Removes the tasks that finished (SUCCEEDED, FAILED, CANCELLED) before now -
DURATION, with their attempts, their dependency edges and their task events, then the idempotency
records that name a task once it is gone, and the others once older than the
retention (--idempotency-before, the same DURATION unless given). Never a concurrency-key
row (a key's row is its token sequence), never an unfinished or NEEDS_REVIEW
task, never anything newer than the bound. A task a plan made goes with the
CREATED trigger that names it, in the same transaction (the plan's trigger
history keeps what the retention keeps).

Every table is walked along its primary key in batches (--batch-size ids,
500 by default): a read of the next ids (outside any transaction), then one
short transaction (@outermost: run again whole after a deadlock or lock-wait
timeout) of DELETEs of those that qualify, re-checked in that transaction
(tasks under their application's lock, then removed by key; events and
records in the DELETEs' own WHERE). Finished tasks are in no counter
(queue_state and application_state count unfinished tasks and active
attempts only: tasks/invariants.py); a batch locks its tasks'
application_state rows only so that a submit naming one of them in
depends_on (which reads its dependencies' states under that row) sees it
either still there or gone, never admits a dependent of a task deleted
under it. What else the prune keeps, and why (docs/decisions.md,
Console and retention):

- a task another task depends on while that one is unfinished (its
  assignment carries this task's state and output, SPEC §13), and one whose
  dependents are not all settled (a DependencySettlement row, or an edge
  left unsettled, which orbit_check reports): once every dependent has
  finished and been settled it goes as any other. A pruned task's edges go
  with it: its own (as a dependent) and those naming it as the dependency;
- each namespace's newest event (its sequence row names that cursor);
- an idempotency record whose task still exists: a replay answers the
  task's receipt for as long as the task is there. Once the task is pruned
  its record goes too, the key is free, and a replay creates a new task."""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Exists, OuterRef
from django.utils import timezone

from orbit import cells
from orbit.db.rows import delete_by_pk, lock_by_pk, writes_sent_together
from orbit.models import ApplicationState, Event, EventSequence, IdempotencyRecord
from orbit.transactions import outermost
from plans.models import PlanTrigger
from tasks.models import FINAL_TASK_STATES, Attempt, DependencySettlement, Task, TaskDependency

DURATION = re.compile(r"^([0-9]{1,9})([smhd])$")
UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
FINISHED = sorted(FINAL_TASK_STATES)
DEFAULT_BATCH = 500
KEPT_FOR_DEPENDENT = "tasks an unfinished task depends on"
KEPT_FOR_SETTLEMENT = "tasks whose dependents are not all settled"


def parse_duration(text: str) -> timedelta:
    """30d, 12h, 90m, 45s."""
    match = DURATION.match(text.strip())
    if match is None:
        raise CommandError(f"{text!r}: a duration is a whole number and a unit s, m, h or d (e.g. 30d, 12h, 90m)")
    return timedelta(**{UNITS[match.group(2)]: int(match.group(1))})


@dataclass
class Tally:
    scanned: int = 0
    tasks: int = 0
    attempts: int = 0
    events: int = 0
    records: int = 0
    kept: dict[str, int] = field(default_factory=dict)

    def keep(self, reason: str, count: int = 1) -> None:
        if count:
            self.kept[reason] = self.kept.get(reason, 0) + count


def batches(model: Any, fields: tuple[str, ...], size: int) -> Iterable[list[tuple[Any, ...]]]:
    """The table's rows, `size` at a time along the primary key (each read one
    short LIMIT query, outside any transaction)."""
    last: Any = None
    while True:
        rows = model.objects.order_by("pk")
        if last is not None:
            rows = rows.filter(pk__gt=last)
        page = list(rows.values_list("pk", *fields)[:size])
        if not page:
            return
        yield page
        last = page[-1][0]
        if len(page) < size:
            return


class Command(BaseCommand):
    help = (
        "Remove tasks finished before now - DURATION (with their attempts and events) and idempotency records "
        "past the retention, in small batches; --dry-run counts only."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--finished-before", required=True, metavar="DURATION", help="e.g. 30d, 12h, 90m")
        parser.add_argument(
            "--idempotency-before",
            metavar="DURATION",
            help="idempotency records that name no task older than this (default: --finished-before); a "
            "record naming a task goes with its task",
        )
        parser.add_argument("--dry-run", action="store_true", help="count what would go; remove nothing")
        parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH, help="ids per transaction (500)")

    def handle(self, *args: Any, **options: Any) -> None:
        now = timezone.now()
        bounds: dict[str, datetime] = {}
        for option in ("finished_before", "idempotency_before"):
            # Omitted, not empty: `--idempotency-before=` is a bad duration, not the default.
            given = options[option] is not None
            text = options[option] if given else options["finished_before"]
            flag = "--" + (option if given else "finished_before").replace("_", "-")
            try:
                bounds[option] = now - parse_duration(text)
            except CommandError as refused:
                raise CommandError(f"{flag} {refused}") from None
            except OverflowError:
                raise CommandError(f"{flag} {text!r}: reaches before the year 1; give a shorter duration") from None
        bound, record_bound = bounds["finished_before"], bounds["idempotency_before"]
        size = options["batch_size"]
        if not 1 <= size <= 10_000:
            raise CommandError("--batch-size: 1 to 10000")
        self.dry_run = options["dry_run"]
        tally = Tally()
        started = time.monotonic()
        mode = "dry run: nothing is removed" if self.dry_run else "removing"
        self.stdout.write(f"orbit_prune: tasks finished before {bound.isoformat()}; {mode}")
        for cell in cells.each():  # with cells, one after another, each in its own rows
            with cells.in_cell(cell):
                if cell is not None:
                    self.stdout.write(f"orbit_prune: cell {cell}")
                self.prune_tasks(bound, size, tally)
                self.prune_events(bound, size, tally)
                self.prune_records(record_bound, bound, size, tally)
        verb = "would remove" if self.dry_run else "removed"
        kept = ", ".join(f"{count} {reason}" for reason, count in sorted(tally.kept.items())) or "nothing"
        self.stdout.write(
            f"orbit_prune: {verb} {tally.tasks} tasks, {tally.attempts} attempts, {tally.events} events, "
            f"{tally.records} idempotency records in {time.monotonic() - started:.1f} s; kept {kept}"
        )

    def progress(self, table: str, scanned: int, removed: int) -> None:
        verb = "would remove" if self.dry_run else "removed"
        self.stdout.write(f"  {table}: scanned {scanned}, {verb} {removed}")

    # ------------------------------------------------------------------ tasks

    def prune_tasks(self, bound: datetime, size: int, tally: Tally) -> None:
        scanned = 0
        for page in batches(Task, ("state", "finished_at", "application_id"), size):
            scanned += len(page)
            chosen: dict[str, str] = {}
            for task_id, state, finished_at, application_id in page:
                if state not in FINAL_TASK_STATES or finished_at is None or finished_at >= bound:
                    continue
                chosen[task_id] = application_id
            if chosen:
                tasks, attempts, kept = self.remove_tasks(chosen, bound)
                tally.tasks += tasks
                tally.attempts += attempts
                for reason, count in kept.items():
                    tally.keep(reason, count)
            self.progress("tasks", scanned, tally.tasks)

    def remove_tasks(self, chosen: dict[str, str], bound: datetime) -> tuple[int, int, dict[str, int]]:
        """Removes these tasks (id → application id) that are still finished
        before the bound and that no dependent holds, with their attempts,
        edges, any settlement row and the plan trigger that made it (read in
        the transaction that read the task finished: a trigger commits with
        its task); returns the tasks, the attempts and
        the kept counts by reason."""
        ids = sorted(chosen)

        @outermost
        def once() -> tuple[int, int, dict[str, int]]:
            if not self.dry_run:
                # The lock a submit reads its dependencies' states under (orbit.locking: first here).
                lock_by_pk(ApplicationState, sorted(set(chosen.values())))
            # Re-checked here: only rows still finished before the bound go.
            finished = list(
                Task.objects.filter(id__in=ids, state__in=FINISHED, finished_at__lt=bound).values_list("id", flat=True)
            )
            held = held_by_dependents(finished)
            kept = dict(Counter(held.values()))
            gone = [task_id for task_id in finished if task_id not in held]
            if not gone:
                return 0, 0, kept
            attempts = list(Attempt.objects.filter(task_id__in=gone).values_list("id", flat=True))
            if self.dry_run:
                return len(gone), len(attempts), kept
            # Its own edges, then those naming it: all settled, or it would have been held.
            edges = [
                *TaskDependency.objects.filter(task_id__in=gone).values_list("id", flat=True),
                *TaskDependency.objects.filter(depends_on_id__in=gone, settled=True).values_list("id", flat=True),
            ]
            settlements = DependencySettlement.objects.filter(task_id__in=gone).values_list("task_id", flat=True)
            triggers = PlanTrigger.objects.filter(task_id__in=gone).values_list("id", flat=True)
            # Read without locks, then removed row by row: nothing else changes
            # these rows under the application's lock (a finished task's state,
            # attempts and edges are final), and a delete by key never waits
            # for rows it does not remove (orbit.db.rows.delete_by_pk).
            with writes_sent_together():
                delete_by_pk(Task, gone)
                delete_by_pk(Attempt, attempts)
                delete_by_pk(TaskDependency, sorted(set(edges)))
                delete_by_pk(DependencySettlement, settlements)
                delete_by_pk(PlanTrigger, triggers)
            return len(gone), len(attempts), kept

        return once()

    # ------------------------------------------------------------------ events

    def prune_events(self, bound: datetime, size: int, tally: Tally) -> None:
        """Task events older than the bound whose task is gone. The event id
        grows with time: the walk stops at the first batch newer than the bound."""
        scanned = 0
        for page in batches(Event, ("namespace_id", "seq", "type", "subject_id", "created_at"), size):
            scanned += len(page)
            old = [row for row in page if row[5] < bound and row[3].startswith("task.")]
            subjects = {row[4] for row in old}
            existing = set(Task.objects.filter(id__in=subjects).values_list("id", flat=True)) if subjects else set()
            if self.dry_run:
                # The dry run removed no task: count the events of the tasks it would remove.
                existing -= self.finished_before(subjects, bound)
            namespaces = {row[1] for row in old}
            newest = dict(
                EventSequence.objects.filter(namespace_id__in=namespaces).values_list("namespace_id", "last_seq")
            )
            chosen = []
            for event_id, namespace_id, seq, _type, subject_id, _created in old:
                if subject_id in existing:
                    continue
                if newest.get(namespace_id) == seq:
                    tally.keep("newest events of a namespace")
                    continue
                chosen.append(event_id)
            if chosen:
                tally.events += self.remove(Event.objects.filter(id__in=chosen, created_at__lt=bound))
            self.progress("events", scanned, tally.events)
            if all(row[5] >= bound for row in page):
                return

    # ------------------------------------------------------------------ idempotency records

    def prune_records(self, bound: datetime, task_bound: datetime, size: int, tally: Tally) -> None:
        """Records that name a task go once their task is gone, those older than
        either bound (a pruned task's submit, cancel and resolve were stored
        before it finished, so before --finished-before); records of other
        operations go once older than `bound` (--idempotency-before). A dry run
        counts as gone the tasks its task pass would have removed."""
        scanned = 0
        walk_bound = max(bound, task_bound)
        for page in batches(IdempotencyRecord, ("created_at", "response_data"), size):
            scanned += len(page)
            old = [(row_id, created_at, task_of(data)) for row_id, created_at, data in page if created_at < walk_bound]
            named = {task_id for _, _, task_id in old if task_id}
            existing = set(Task.objects.filter(id__in=named).values_list("id", flat=True)) if named else set()
            if self.dry_run:
                existing -= self.finished_before(named, task_bound)
            chosen = []
            for record_id, created_at, task_id in old:
                if task_id and task_id in existing:
                    tally.keep("idempotency records of a task still there")
                elif task_id or created_at < bound:
                    chosen.append(record_id)
            if chosen:
                rows = IdempotencyRecord.objects.filter(id__in=chosen, created_at__lt=walk_bound)
                tally.records += self.remove(rows)
            self.progress("idempotency records", scanned, tally.records)
            if all(row[1] >= walk_bound for row in page):
                return

    # ------------------------------------------------------------------ plumbing

    def finished_before(self, task_ids: set[str], bound: datetime) -> set[str]:
        """Of these tasks, those the (dry) run would remove."""
        if not task_ids:
            return set()
        finished = Task.objects.filter(id__in=task_ids, state__in=FINISHED, finished_at__lt=bound)
        chosen = set(finished.values_list("id", flat=True))
        return chosen - set(held_by_dependents(sorted(chosen)))

    def remove(self, rows: Any) -> int:
        if self.dry_run:
            return rows.count()

        @outermost
        def once() -> int:
            return rows.delete()[0]

        return once()


def held_by_dependents(task_ids: list[str]) -> dict[str, str]:
    """Of these finished tasks, those a dependent still needs, with the
    reason: an unfinished task depends on it, or its settlement is not done
    (a DependencySettlement row, or an edge left unsettled). One statement
    with two semi-joins per task, each a range of idx_dependency_parent
    (the dependents' rows by primary key), plus the settlement rows by
    primary key: a task without dependents costs one index probe."""
    if not task_ids:
        return {}
    unfinished_dependent = TaskDependency.objects.filter(depends_on_id=OuterRef("id")).filter(
        Exists(Task.objects.filter(id=OuterRef("task_id")).exclude(state__in=FINISHED))
    )
    unsettled_edge = TaskDependency.objects.filter(depends_on_id=OuterRef("id"), settled=False)
    # In the select list only: a WHERE on them lets MariaDB turn the semi-join
    # into a materialized scan of every unfinished task.
    rows = (
        Task.objects.filter(id__in=task_ids)
        .annotate(waited_on=Exists(unfinished_dependent), unsettled=Exists(unsettled_edge))
        .values_list("id", "waited_on", "unsettled")
    )
    held = {
        task_id: KEPT_FOR_DEPENDENT if waited_on else KEPT_FOR_SETTLEMENT
        for task_id, waited_on, unsettled in rows
        if waited_on or unsettled
    }
    for task_id in DependencySettlement.objects.filter(task_id__in=task_ids).values_list("task_id", flat=True):
        held.setdefault(task_id, KEPT_FOR_SETTLEMENT)
    return held


def task_of(data: Any) -> str | None:
    """The task a record's receipt names (task.submit, task.cancel, task.resolve)."""
    task = data.get("task") if isinstance(data, dict) else None
    task_id = task.get("id") if isinstance(task, dict) else None
    return task_id if isinstance(task_id, str) else None

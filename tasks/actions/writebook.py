"""A group of transitions' writes, made once: the counter changes and row
updates that tasks.actions.permits decides for each ending or move, summed
per counter row and merged per table, for the caller to write when its group
is done (a round's results, a settling dependency's cancelled dependents)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from django.db.models import Model

from orbit.db.rows import Pk, add_to_row, update_each_by_pk
from orbit.models import ApplicationState
from queues.models import QueueState


@dataclass
class CounterDeltas:
    """Counter changes of one transition, written as one UPDATE per row."""

    active_attempts: int = 0
    app_unfinished: int = 0
    active_permits: int = 0
    reserved_starts: int = 0
    queue_unfinished: int = 0

    def write(self, *, application_id: str, queue_id: str) -> None:
        app = {"active_attempts": self.active_attempts, "unfinished_tasks": self.app_unfinished}
        queue = {
            "active_permits": self.active_permits,
            "reserved_starts": self.reserved_starts,
            "unfinished_tasks": self.queue_unfinished,
        }
        add_to_row(ApplicationState, application_id, {name: n for name, n in app.items() if n})
        add_to_row(QueueState, queue_id, {name: n for name, n in queue.items() if n})

    def add(self, other: CounterDeltas) -> None:
        for counter in dataclasses.fields(self):
            setattr(self, counter.name, getattr(self, counter.name) + getattr(other, counter.name))


@dataclass
class WriteBook:
    """The writes of a group of transitions in one transaction (a round),
    made once at `write()`: counter changes summed per row, and row updates
    merged into one UPDATE per table and set of fields. Every row in it
    is locked already; the caller writes the book before anything reads
    those rows again."""

    deltas: dict[tuple[str, str], CounterDeltas] = field(default_factory=dict)
    rows: dict[int, tuple[Model, set[str]]] = field(default_factory=dict)

    def add(self, *, application_id: str, queue_id: str, deltas: CounterDeltas) -> None:
        self.deltas.setdefault((application_id, queue_id), CounterDeltas()).add(deltas)

    def save(self, row: Model, fields: list[str]) -> None:
        """Like row.save(update_fields=fields), at write(); the row's values then are written."""
        self.rows.setdefault(id(row), (row, set()))[1].update(fields)

    def write(self) -> None:
        # One UPDATE per table and set of fields: each row its own values where
        # they differ (a released key's version), one value where they agree.
        alike: dict[tuple[type[Model], tuple[str, ...]], dict[Pk, dict[str, Any]]] = {}
        for row, fields in self.rows.values():
            names = tuple(sorted(fields))
            alike.setdefault((type(row), names), {})[row.pk] = {name: getattr(row, name) for name in names}
        for (model, _), rows in alike.items():
            update_each_by_pk(model, rows)
        for (application_id, queue_id), deltas in sorted(self.deltas.items()):
            deltas.write(application_id=application_id, queue_id=queue_id)
        self.rows.clear()
        self.deltas.clear()

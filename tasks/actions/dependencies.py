"""Settling dependencies (SPEC §13): when a task with dependents enters a
final state, each of its edges is settled once. A BLOCKED dependent counts
one dependency fewer (`blocked_by`) and becomes WAITING at zero, or, after a
failed or cancelled dependency under CANCEL, is cancelled with
DEPENDENCY_FAILED, which settles its own dependents in turn.

Every settlement holds the application's state row: the ending that calls it
does, and the follow-up locks it first. Dependents are task rows of the same
application (a namespace belongs to one application), locked after the
ending's own rows; every other transaction that waits on a task row holds the
same application row first (leases skip locked rows), so that cannot close
a cycle (docs/architecture/locking.md).

The ending's transaction settles up to INLINE_EDGES edges, transitive
cancellations included; a wider fan-out leaves a DependencySettlement row,
written in the same transaction, and the follow-up (run_follow_ups, nudged
after the commit and swept by maintenance) settles the rest FOLLOW_UP_CHUNK
edges a transaction, so no transaction holds the application's counters for
long. A follow-up chunk that cancels locks its dependents' queue_state rows
before their task rows (LOCK_ORDER); a cascade of it whose cancellations
would move another queue's counters gets a settlement row of its own."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from django.db import transaction
from django.utils import timezone

from orbit import cells
from orbit.audit import emit_event
from orbit.db.rows import Add, insert_rows, lock_by_pk, lock_fields_by_pk, new_row, update_by_pk
from orbit.errors import InvalidArgument
from orbit.transactions import outermost
from queues.locks import lock_queue_states
from tasks import wakeups
from tasks.actions.writebook import WriteBook
from tasks.locks import lock_application_state
from tasks.models import (
    FINAL_TASK_STATES,
    DependencyFailure,
    DependencySettlement,
    Task,
    TaskDependency,
    TaskState,
)
from tasks.serializers import REF_PREFIX

# Edges one ending's transaction settles itself (its cascade included).
INLINE_EDGES = 200
# Edges a follow-up transaction settles.
FOLLOW_UP_CHUNK = 500
FAILED_DEPENDENCY_STATES = frozenset({TaskState.FAILED, TaskState.CANCELLED})

# settle(task, held, now=..., task_state=..., **fields): tasks.actions.permits.settle,
# handed in by its caller (permits imports this module, not the other way).
Transition = Callable[..., None]


@dataclass
class _Budget:
    edges: int = INLINE_EDGES
    # In a follow-up: the queues whose queue_state rows it locked before any
    # task row (LOCK_ORDER). A cascade whose cancellations would move another
    # queue's counters is left to a settlement row of its own.
    queues: frozenset[str] | None = None

    @property
    def in_follow_up(self) -> bool:
        return self.queues is not None


_inline = threading.local()

# What settling reads of a dependent. A follow-up (its own transaction, no
# round's rows locked ahead) locks only these columns: decoding the full rows'
# JSON and times was most of a 500-edge chunk's Python. A dependent that goes
# through the transition (cancelled, or keyed) is read whole then.
SETTLING_FIELDS = ("id", "namespace_id", "queue_id", "state", "on_dependency_failure", "blocked_by", "concurrency_key")


def dependency_failed(parent_id: str, state: str) -> dict[str, Any]:
    return {
        "code": "DEPENDENCY_FAILED",
        "message": f"dependency {parent_id} ended {state}",
        "task_id": parent_id,
        "state": state,
    }


def settle_dependents(parent: Task, now: datetime, transition: Transition) -> None:
    """Called as `parent` (has_dependents) enters a final state, inside its
    transaction: settles its edges within the transaction's inline budget,
    and leaves the rest to the follow-up."""
    outer = getattr(_inline, "budget", None)
    budget = outer if outer is not None else _Budget()
    _inline.budget = budget
    try:
        if budget.edges <= 0 or _settle_chunk(parent, min(budget.edges, FOLLOW_UP_CHUNK), now, transition, budget):
            DependencySettlement.objects.get_or_create(
                task_id=parent.id,
                defaults={
                    "namespace_id": parent.namespace_id,
                    "application_id": parent.application_id,
                    "created_at": now,
                },
            )
            transaction.on_commit(nudge_follow_up)
    finally:
        if outer is None:
            _inline.budget = None


def _settle_chunk(parent: Task, limit: int, now: datetime, transition: Transition, budget: _Budget) -> bool:
    """Settles up to `limit` of the parent's unsettled edges, in edge order;
    returns whether more are left."""
    edges = _unsettled_edges(parent.id, limit + 1)
    more = len(edges) > limit
    edges = edges[:limit]
    if not edges:
        return False
    failed = parent.state in FAILED_DEPENDENCY_STATES
    if failed and budget.queues is not None and not _queues_of(edges) <= budget.queues:
        return True
    budget.edges -= len(edges)
    dependents = _lock_dependents(sorted({edge.task_id for edge in edges}), budget.in_follow_up)
    update_by_pk(TaskDependency, [edge.id for edge in edges], {"settled": True})
    counted: list[Task] = []
    cancelled: list[Task] = []
    for edge in edges:
        dependent = dependents.get(edge.task_id)
        if dependent is None or dependent.state != TaskState.BLOCKED:
            continue  # it ended otherwise already (cancelled, its deadline): nothing to settle
        if failed and dependent.on_dependency_failure == DependencyFailure.CANCEL:
            cancelled.append(dependent)
        else:
            counted.append(dependent)
    _count_down(counted, now, transition, whole=budget.in_follow_up)
    _cancel(_whole(cancelled, budget.in_follow_up), parent, now, transition)
    return more


def _cancel(dependents: list[Task], parent: Task, now: datetime, transition: Transition) -> None:
    """Cancels each (DEPENDENCY_FAILED), once. Those without dependents of their
    own go into one book, their rows in one UPDATE and the counters in one per
    row, where each alone cost three statements (a chunk of 500 held the
    application's counter row for half a second). Those with dependents follow
    one at a time once the book is written, each read again first: a sibling's
    cascade may have cancelled it since it was locked (a diamond: the parent, a
    child, and a task that depends on both), and its own settling reads the
    leaves again."""
    error = dependency_failed(parent.id, parent.state)
    book = WriteBook()
    for dependent in dependents:
        if not dependent.has_dependents:
            transition(dependent, None, now=now, task_state=TaskState.CANCELLED, last_error=error, book=book)
    book.write()
    for dependent in dependents:
        if dependent.has_dependents:
            current = lock_by_pk(Task, [dependent.id])[dependent.id]
            if current.state == TaskState.BLOCKED:
                transition(current, None, now=now, task_state=TaskState.CANCELLED, last_error=error)


def _lock_dependents(ids: list[str], narrow: bool) -> dict[str, Task]:
    if not narrow:
        return lock_by_pk(Task, ids)
    return lock_fields_by_pk(Task, ids, SETTLING_FIELDS)


def _whole(dependents: list[Task], narrow: bool) -> list[Task]:
    """The dependents as full rows (already locked by this transaction)."""
    if not narrow or not dependents:
        return dependents
    rows = lock_by_pk(Task, [d.id for d in dependents])
    return [rows[d.id] for d in dependents]


class Edge(NamedTuple):
    id: int
    task_id: str  # the dependent


def _unsettled_edges(parent_id: str, limit: int) -> list[Edge]:
    # Tuples, not model instances: a wide fan-out reads 500 a chunk.
    rows = TaskDependency.objects.filter(depends_on_id=parent_id, settled=False).order_by("id")[:limit]
    return [Edge(*row) for row in rows.values_list("id", "task_id")]


def _queues_of(edges: list[Edge]) -> frozenset[str]:
    """The queues of the edges' dependents, read without a lock (a task's queue never changes)."""
    ids = sorted({edge.task_id for edge in edges})
    return frozenset(Task.objects.filter(id__in=ids).values_list("queue_id", flat=True))


def _count_down(dependents: list[Task], now: datetime, transition: Transition, *, whole: bool) -> None:
    """One dependency fewer for each; those with none left become WAITING
    (unkeyed ones in one statement; a keyed one takes its key's ready role
    through the transition)."""
    if not dependents:
        return
    for dependent in dependents:
        dependent.blocked_by = max(0, dependent.blocked_by - 1)
    still = [d.id for d in dependents if d.blocked_by > 0]
    update_by_pk(Task, still, {"blocked_by": Add(-1)})
    ready = [d for d in dependents if d.blocked_by == 0]
    plain = [d for d in ready if not d.concurrency_key]
    update_by_pk(
        Task,
        [d.id for d in plain],
        {"state": TaskState.WAITING, "blocked_by": 0, "key_ready": True, "updated_at": now},
    )
    for dependent in plain:
        dependent.state, dependent.key_ready, dependent.updated_at = TaskState.WAITING, True, now
        emit_event(
            namespace_id=dependent.namespace_id,
            type="task.state_changed",
            subject_id=dependent.id,
            data={"queue_id": dependent.queue_id, "state": TaskState.WAITING, "previous": TaskState.BLOCKED},
        )
    for dependent in _whole([d for d in ready if d.concurrency_key], whole):
        transition(dependent, None, now=now, task_state=TaskState.WAITING, blocked_by=0)
    if ready:
        wakeups.wake_after_commit(sorted({d.queue_id for d in ready}))


# --- submits: depends_on resolved, checked, admitted -------------------------


@dataclass(frozen=True)
class EarlierItem:
    """depends_on's `ref:NAME` of an item of the same batch being created in
    the same call: its task id is known once its row is prepared."""

    index: int  # into the call's pending list
    name: str  # its ref, to name it should it not be accepted


Dependency = str | EarlierItem
# The refs a prepared task's depends_on named: task id → position → ref.
EarlierRefs = dict[str, dict[int, str]]


def resolve_depends_on(
    namespace_id: str,
    refs: list[str | None],
    in_batch: bool,
    replayed: dict[int, str],
    pending: list[tuple[int, dict[str, Any]]],
    *,
    queue_ids: frozenset[str] | None,
) -> tuple[list[tuple[int, dict[str, Any]]], dict[int, InvalidArgument]]:
    """The unlocked check of the pending items' depends_on (items by index:
    `refs` their batch refs, `replayed` the task ids of those answered from
    their record). Each `ref:NAME` becomes the task id of an earlier item that
    was replayed, or an EarlierItem for one being created now; each id must
    name a task of the namespace in the caller's queue range `queue_ids`
    (None: every queue). A foreign id, or one outside the range, answers as an
    unknown one: its GET is 404, so naming it must neither reveal it nor let
    its dependent (and that one's assignment) read its state and output.
    Returns the pending items with their depends_on resolved (new field
    dicts: a round decided again resolves again), and the refusals by index."""
    wanted = {
        entry for _, fields in pending for entry in fields.get("depends_on") or [] if not entry.startswith(REF_PREFIX)
    }
    if not wanted and not any(fields.get("depends_on") for _, fields in pending):
        return pending, {}
    tasks = Task.objects.filter(namespace_id=namespace_id, id__in=sorted(wanted))
    if queue_ids is not None:
        tasks = tasks.filter(queue_id__in=sorted(queue_ids))
    known = set(tasks.values_list("id", flat=True))
    accepted: list[tuple[int, dict[str, Any]]] = []
    refused: dict[int, InvalidArgument] = {}
    named: dict[str, int] = {}  # ref → the index of the earlier item that has it
    pending_fields = dict(pending)
    for index, ref in enumerate(refs):
        fields = pending_fields.get(index)
        if fields is not None:
            try:
                if fields.get("depends_on"):
                    place = {earlier: position for position, (earlier, _) in enumerate(accepted)}
                    resolved = [
                        _resolved(at, entry, in_batch, named, replayed, place, known)
                        for at, entry in enumerate(fields["depends_on"])
                    ]
                    _refuse_repeats(resolved)
                    fields = {**fields, "depends_on": resolved}
                accepted.append((index, fields))
            except InvalidArgument as refusal:
                refused[index] = refusal
        if ref is not None:
            named[ref] = index
    return accepted, refused


def _resolved(
    at: int,
    entry: str,
    in_batch: bool,
    named: dict[str, int],
    replayed: dict[int, str],
    place: dict[int, int],
    known: set[str],
) -> Dependency:
    where = f"depends_on[{at}]"
    if not entry.startswith(REF_PREFIX):
        if entry not in known:
            raise InvalidArgument(f"{where}: task not found")
        return entry
    if not in_batch:
        raise InvalidArgument(f"{where}: ref:NAME names an earlier item of the same POST /v1/tasks:batch")
    name = entry[len(REF_PREFIX) :]
    earlier = named.get(name)
    if earlier is None:
        raise InvalidArgument(f"{where}: no earlier item of this batch has ref {name}")
    if earlier in replayed:
        return replayed[earlier]
    if earlier not in place:
        raise InvalidArgument(f"{where}: the item with ref {name} was not accepted")
    return EarlierItem(place[earlier], name)


def _refuse_repeats(resolved: list[Dependency]) -> None:
    """A ref of a replayed item resolves to a task id the same list may
    also name directly: one dependency twice, refused as the validator
    refuses a repeated id."""
    seen: dict[Dependency, int] = {}
    for at, dependency in enumerate(resolved):
        if dependency in seen:
            raise InvalidArgument(f"depends_on[{at}]: repeats entry {seen[dependency]}")
        seen[dependency] = at


def link_dependencies(tasks: list[Task | None], items: list[dict[str, Any]]) -> EarlierRefs:
    """Before any lock, on the rows prepared for `items` (not inserted yet):
    each task's depends_on (an EarlierItem replaced by that item's task id,
    "" for one without a row, which admission refuses), BLOCKED until
    admission decides; an earlier item of the call depended on knows it has
    dependents before its row is written. Returns the refs each task named,
    by task id and position: admission names the ref of an earlier item it
    refused."""
    refs: EarlierRefs = {}
    for task, fields in zip(tasks, items, strict=True):
        wanted = fields.get("depends_on")
        if task is None or not wanted:
            continue
        task.on_dependency_failure = fields.get("on_dependency_failure", DependencyFailure.CANCEL)
        ids: list[str] = []
        for at, entry in enumerate(wanted):
            if isinstance(entry, EarlierItem):
                earlier = tasks[entry.index]
                ids.append(earlier.id if earlier is not None else "")
                refs.setdefault(task.id, {})[at] = entry.name
                if earlier is not None:
                    earlier.has_dependents = True
            else:
                ids.append(entry)
        task.depends_on = ids
        task.state = TaskState.BLOCKED
        task.blocked_by = len(ids)
    return refs


def parent_states(tasks: list[Task | None]) -> dict[str, str]:
    """Under the application's lock: the states of the dependencies these
    prepared tasks name outside their own call, read once. No other
    transaction ends them meanwhile (every ending holds the same lock)."""
    own = {task.id for task in tasks if task is not None}
    wanted = sorted({p for t in tasks if t is not None for p in t.depends_on or [] if p and p not in own})
    if not wanted:
        return {}
    # Only the callers' own namespace: a plan's tasks come here without the
    # submit path's check (resolve_depends_on), and a foreign id must answer
    # as an unknown one, never wait on (or reveal) another tenant's task.
    namespaces = sorted({task.namespace_id for task in tasks if task is not None})
    return dict(Task.objects.filter(id__in=wanted, namespace_id__in=namespaces).values_list("id", "state"))


def decide(
    task: Task, accepted: dict[str, Task], states: dict[str, str], refs: EarlierRefs, now: datetime
) -> InvalidArgument | None:
    """Under the application's lock, in item order: the state a task with
    dependencies is admitted in (SPEC §13), from its dependencies' states
    (`accepted`: this call's tasks admitted so far, whose states count as
    they are now). BLOCKED while one is unfinished (`blocked_by` of them);
    else WAITING, or CANCELLED (DEPENDENCY_FAILED) after a failed or
    cancelled one under CANCEL. A refusal for a dependency that is gone (an
    earlier item of the call not accepted, named by its ref, or a task
    pruned since the first check)."""
    failed: tuple[str, str] | None = None
    unfinished = 0
    for at, parent_id in enumerate(task.depends_on or []):
        parent = accepted.get(parent_id)
        state = parent.state if parent is not None else states.get(parent_id)
        if state is None:
            name = refs.get(task.id, {}).get(at)
            if name is not None:
                return InvalidArgument(f"depends_on[{at}]: the item with ref {name} was not accepted")
            return InvalidArgument(f"depends_on[{at}]: task not found")
        if failed is None and state in FAILED_DEPENDENCY_STATES:
            failed = (parent_id, state)
        if state not in FINAL_TASK_STATES:
            unfinished += 1
    if failed is not None and task.on_dependency_failure == DependencyFailure.CANCEL:
        task.state, task.blocked_by = TaskState.CANCELLED, 0
        task.finished_at, task.last_error = now, dependency_failed(*failed)
    elif unfinished:
        task.state, task.blocked_by = TaskState.BLOCKED, unfinished
    else:
        task.state, task.blocked_by = TaskState.WAITING, 0
    return None


def write_admitted(tasks: list[Task], accepted: dict[str, Task], states: dict[str, str]) -> None:
    """The writes of admitted tasks with dependencies, under the lock: the
    rows whose state admission changed, their edges (an edge to a finished
    dependency, or of a task that is not BLOCKED, settled already), and the
    unfinished dependencies outside the call marked as having dependents."""
    edges: list[TaskDependency] = []
    marked: set[str] = set()
    for task in tasks:
        if task.state != TaskState.BLOCKED or task.blocked_by != len(task.depends_on or []):
            changed = ["state", "blocked_by", "finished_at", "last_error"]
            update_by_pk(Task, [task.id], {name: getattr(task, name) for name in changed})
        for at, parent_id in enumerate(task.depends_on or []):
            state = accepted[parent_id].state if parent_id in accepted else states[parent_id]
            open_edge = task.state == TaskState.BLOCKED and state not in FINAL_TASK_STATES
            if open_edge and parent_id not in accepted:
                marked.add(parent_id)
            edges.append(
                new_row(
                    TaskDependency,
                    namespace_id=task.namespace_id,
                    task_id=task.id,
                    depends_on_id=parent_id,
                    position=at,
                    settled=not open_edge,
                )
            )
    insert_rows(edges)
    if marked:
        update_by_pk(Task, sorted(marked), {"has_dependents": True})


# --- what a dependent's assignment carries ---------------------------------


def attach_dependencies(entries: list[tuple[Task, dict[str, Any]]]) -> None:
    """Adds `dependencies` ({task_id, state, output?} per dependency, in
    depends_on order) to the assignments of tasks that have them: one read
    for all of them."""
    wanted = [(task, entry) for task, entry in entries if task.depends_on]
    if not wanted:
        return
    ids = sorted({parent for task, _ in wanted for parent in task.depends_on or []})
    parents = {row.id: row for row in Task.objects.filter(id__in=ids).only("id", "state", "output")}
    for task, entry in wanted:
        entry["dependencies"] = [
            _dependency_view(parent_id, parents.get(parent_id)) for parent_id in task.depends_on or []
        ]


def _dependency_view(task_id: str, parent: Task | None) -> dict[str, Any]:
    if parent is None:  # orbit_prune keeps a dependency while a dependent is unfinished: never, but not a 500
        return {"task_id": task_id}
    view: dict[str, Any] = {"task_id": task_id, "state": parent.state}
    if parent.output is not None:
        view["output"] = parent.output
    return view


# --- the follow-up --------------------------------------------------------

# One per cell (None: no cell), as each cell has a maintenance loop of its own:
# a loop woken for another cell's settlement would clear this one's nudge.
_nudges: dict[str | None, threading.Event] = {}


def nudged() -> threading.Event:
    """The event that wakes the maintenance loop of the cell entered."""
    cell = cells.entered()
    event = _nudges.get(cell)
    if event is None:
        event = _nudges.setdefault(cell, threading.Event())
    return event


def nudge_follow_up() -> None:
    """Wakes this process's maintenance loop of the cell entered for a settlement left to do."""
    nudged().set()


def run_follow_ups(transition: Transition, *, limit: int = 100) -> int:
    """Settles what the endings left (DependencySettlement rows, oldest
    first), a chunk a transaction, until none is left; returns the chunks."""
    nudged().clear()
    chunks = 0
    for settlement in DependencySettlement.objects.order_by("created_at")[:limit]:
        while _follow_up_chunk(settlement.task_id, settlement.application_id, transition):
            chunks += 1
        chunks += 1
    return chunks


@outermost
def _follow_up_chunk(task_id: str, application_id: str, transition: Transition) -> bool:
    """One transaction: the application's state row, then the next chunk of
    the task's edges; the settlement row goes once none is left. Returns
    whether more are left. Another node may run the same one: the edges are
    read under the application's lock, so each is settled once."""
    lock_application_state(application_id)
    parent = Task.objects.filter(id=task_id).first()
    if parent is None:
        DependencySettlement.objects.filter(task_id=task_id).delete()
        return False
    queues: frozenset[str] = frozenset()
    if parent.state in FAILED_DEPENDENCY_STATES:
        # The chunk cancels dependents, which moves their queues' counters:
        # those queue_state rows are locked before the task rows, found by a
        # first read without a lock (edges change only under the lock held).
        queues = _queues_of(_unsettled_edges(parent.id, FOLLOW_UP_CHUNK))
        lock_queue_states(queues)
    now = timezone.now()
    _inline.budget = _Budget(FOLLOW_UP_CHUNK, queues)
    try:
        more = _settle_chunk(parent, FOLLOW_UP_CHUNK, now, transition, _inline.budget)
    finally:
        _inline.budget = None
    if not more:
        DependencySettlement.objects.filter(task_id=task_id).delete()
    return more

"""Recomputes every counter and permit from the rows and reports drift.

Used by `manage.py orbit_check`, the chaos harness and after every concurrent
test. Read-only."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Count, Max, Min, Q
from django.utils import timezone

from orbit.models import Application, ApplicationState, CellPlacement, Event, EventSequence
from plans.models import Plan, PlanTrigger, TriggerOutcome
from queues.models import Queue, QueueState
from tasks.key_rules import PolicySet, Rate, read_policy_set
from tasks.models import (
    ACTIVE_ATTEMPT_STATES,
    FINAL_TASK_STATES,
    Attempt,
    AttemptState,
    ConcurrencyKey,
    ConcurrencySlot,
    DependencyFailure,
    DependencySettlement,
    KeyPolicy,
    Task,
    TaskDependency,
    TaskState,
    WorkerIdentity,
)

# BLOCKED tasks count too: they hold a backlog slot from their submit (SPEC §13).
UNFINISHED_STATES = [TaskState.BLOCKED, TaskState.WAITING, TaskState.LEASED, TaskState.RUNNING, TaskState.NEEDS_REVIEW]
# A round reads a namespace's key policies ahead of its transaction (SPEC §10): a lease
# committed this long after a policy change is sure to have applied the change.
POLICY_SETTLE = timedelta(seconds=5)
# A wide fan-out's follow-up settles within a second (SPEC §13); a settlement row
# older than this is one no follow-up is getting through.
SETTLEMENT_STUCK_AFTER = timedelta(seconds=60)
# The dependency checks of finished tasks look at the tasks of this many most
# recent leases (idx_attempt_leased): a bounded read, whatever the history.
RECENT_LEASES = 10_000
# Ids per IN list of the dependency checks.
ID_CHUNK = 1000
# The tasks that count as having run, or as about to: a dependency of theirs
# must have finished, and not failed under CANCEL.
PAST_BLOCKED_STATES = frozenset({TaskState.WAITING, TaskState.LEASED, TaskState.RUNNING, TaskState.NEEDS_REVIEW})
FAILED_STATES = frozenset({TaskState.FAILED, TaskState.CANCELLED})
# The GCRA replay's slack for the timestamps' rounding (the rate's interval is whole microseconds).
RATE_TOLERANCE = timedelta(milliseconds=1)


def find_violations_in_snapshot() -> list[str]:
    """find_violations as of one instant, so it is exact while work goes on.

    At READ COMMITTED each query sees its own moment, and a commit between two
    of them looks like drift. On MySQL the checks run in one REPEATABLE READ
    transaction (one consistent snapshot); SQLite's read transaction already is one.
    Inside a transaction already (a test case's, a shell's) they run in that one:
    its isolation level can no longer change."""
    if connection.in_atomic_block:
        return find_violations()
    with transaction.atomic():
        if connection.vendor == "mysql":
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        return find_violations()


def find_violations() -> list[str]:
    """Every drift between the counters, permits and tokens and the rows they
    count, as one message each (none: consistent)."""
    unfinished = _unfinished_tasks()
    active = _active_attempts()
    problems = _counter_violations(unfinished, active)
    problems.extend(_task_attempt_violations(active))
    problems.extend(_key_violations(active))
    problems.extend(state_row_violations())
    problems.extend(capacity_violations(active))
    problems.extend(attempt_count_violations())
    problems.extend(token_order_violations())
    problems.extend(readiness_violations())
    problems.extend(plan_trigger_violations())
    problems.extend(event_cursor_violations())
    problems.extend(dependency_violations())
    return problems


def _unfinished_tasks() -> list[tuple[str, str, int]]:
    """(queue_id, application_id, count) of the unfinished tasks."""
    return list(
        Task.objects.filter(state__in=UNFINISHED_STATES)
        .values_list("queue_id", "application_id")
        .annotate(n=Count("id"))
        .values_list("queue_id", "application_id", "n")
    )


def _active_attempts() -> list[Mapping[str, Any]]:
    """The LEASED and RUNNING attempts, as the checks read them."""
    return list(
        Attempt.objects.filter(state__in=list(ACTIVE_ATTEMPT_STATES)).values(
            "id",
            "task_id",
            "queue_id",
            "application_id",
            "state",
            "concurrency_key",
            "namespace_id",
            "epoch",
            "worker_id",
            "session_id",
            "concurrency_slot",
            "concurrency_token",
            "leased_at",
            "key_rate_reserved",
        )
    )


def _counter_violations(unfinished: list[tuple[str, str, int]], active: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each queue's and application's counters are what its rows say: its
    unfinished tasks, its active attempts (permits), its reserved Starts
    (LEASED attempts)."""
    problems: list[str] = []
    unfinished_by_queue: Counter[str] = Counter()
    unfinished_by_app: Counter[str] = Counter()
    for queue_id, application_id, count in unfinished:
        unfinished_by_queue[queue_id] += count
        unfinished_by_app[application_id] += count
    active_by_queue = Counter(a["queue_id"] for a in active)
    reserved_by_queue = Counter(a["queue_id"] for a in active if a["state"] == AttemptState.LEASED)
    active_by_app = Counter(a["application_id"] for a in active)
    for state in QueueState.objects.all():
        expected = {
            "unfinished_tasks": unfinished_by_queue.get(state.queue_id, 0),
            "active_permits": active_by_queue.get(state.queue_id, 0),
            "reserved_starts": reserved_by_queue.get(state.queue_id, 0),
        }
        for name, value in expected.items():
            if getattr(state, name) != value:
                problems.append(f"queue {state.queue_id}: {name}={getattr(state, name)} but rows say {value}")

    for app_state in ApplicationState.objects.all():
        if app_state.unfinished_tasks != unfinished_by_app.get(app_state.application_id, 0):
            problems.append(
                f"application {app_state.application_id}: unfinished_tasks={app_state.unfinished_tasks} "
                f"but rows say {unfinished_by_app.get(app_state.application_id, 0)}"
            )
        if app_state.active_attempts != active_by_app.get(app_state.application_id, 0):
            problems.append(
                f"application {app_state.application_id}: active_attempts={app_state.active_attempts} "
                f"but rows say {active_by_app.get(app_state.application_id, 0)}"
            )
    return problems


def _task_attempt_violations(active: Sequence[Mapping[str, Any]]) -> list[str]:
    """Task state agrees with its attempts: one active attempt at most, and
    only for LEASED/RUNNING tasks, in the task's state."""
    problems: list[str] = []
    active_by_task = defaultdict(list)
    for attempt in active:
        active_by_task[attempt["task_id"]].append(attempt)
    for task_id, attempts in active_by_task.items():
        if len(attempts) > 1:
            problems.append(f"task {task_id}: {len(attempts)} active attempts")
    leased_or_running = dict(
        Task.objects.filter(state__in=[TaskState.LEASED, TaskState.RUNNING]).values_list("id", "state")
    )
    for task_id, state in leased_or_running.items():
        attempts = active_by_task.get(task_id, [])
        if len(attempts) != 1 or attempts[0]["state"] != state:
            problems.append(f"task {task_id}: state {state} but active attempts {[a['state'] for a in attempts]}")
    for task_id in active_by_task:
        if task_id not in leased_or_running:
            problems.append(f"task {task_id}: has an active attempt but is not LEASED/RUNNING")
    return problems


def _key_violations(active: Sequence[Mapping[str, Any]]) -> list[str]:
    """The key rows against the attempts: their holders by slot, their
    capacities and rates, their token sequences."""
    holders = {
        (row.namespace_id, row.key): row
        for row in ConcurrencyKey.objects.all().only(
            "namespace_id", "key", "holder_attempt_id", "holder_task_id", "version", "holders", "rate_reserved"
        )
    }
    slots: dict[tuple[str, str], list[ConcurrencySlot]] = defaultdict(list)
    for slot in ConcurrencySlot.objects.all().order_by("namespace_id", "key", "slot"):
        slots[(slot.namespace_id, slot.key)].append(slot)
    policies = {namespace_id: read_policy_set(namespace_id) for namespace_id in {ns for ns, _ in holders}}
    return (
        _key_holder_violations(active, holders, slots)
        + _key_capacity_violations(active, policies)
        + _token_sequence_violations(holders)
        + _slot_token_violations(active, holders, slots)
        + key_rate_violations(active, holders, policies)
    )


def _effective_slot(attempt: Mapping[str, Any]) -> int:
    # A grant under capacity 1 has no concurrency_slot: it holds slot 0, on the key's row.
    slot = attempt["concurrency_slot"]
    return 0 if slot is None else int(slot)


def _key_holder_violations(
    active: Sequence[Mapping[str, Any]],
    holders: Mapping[tuple[str, str], ConcurrencyKey],
    slots: Mapping[tuple[str, str], list[ConcurrencySlot]],
) -> list[str]:
    """Each key's valid permits are exactly its active attempts: the row counts
    them (holders), each holds its own slot, and each slot names its holder
    (slot 0 on the key row, slots 1…N−1 on slot rows), and nothing else."""
    problems: list[str] = []
    active_keyed: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for attempt in active:
        if attempt["concurrency_key"]:
            active_keyed[(attempt["namespace_id"], attempt["concurrency_key"])].append(attempt)
    for ident in sorted(set(active_keyed) | set(holders) | set(slots)):
        attempts = active_keyed.get(ident, [])
        row = holders.get(ident)
        if row is None:
            if attempts:
                problems.append(f"key {ident}: active attempts {[a['id'] for a in attempts]} but no key row")
            continue
        if row.holders != len(attempts):
            problems.append(f"key {ident}: holders={row.holders} but {len(attempts)} active attempts")
        held: dict[int, tuple[str, str]] = {}
        if row.holder_attempt_id:
            held[0] = (row.holder_attempt_id, row.holder_task_id)
        for slot in slots.get(ident, []):
            if slot.slot == 0:
                problems.append(f"key {ident}: a slot row for slot 0, which is the key row's")
            elif slot.holder_attempt_id:
                held[slot.slot] = (slot.holder_attempt_id, slot.holder_task_id)
        by_slot: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
        for attempt in attempts:
            by_slot[_effective_slot(attempt)].append(attempt)
        for number, on_slot in sorted(by_slot.items()):
            if len(on_slot) > 1:
                problems.append(f"key {ident}: slot {number} held by {len(on_slot)} active attempts")
            holder = held.get(number)
            for attempt in on_slot:
                if holder is None or holder[0] != attempt["id"]:
                    problems.append(
                        f"key {ident}: active attempt {attempt['id']} on slot {number} is not the slot's holder"
                    )
                elif holder[1] != attempt["task_id"]:
                    problems.append(
                        f"key {ident}: slot {number} names task {holder[1]}, its attempt's is {attempt['task_id']}"
                    )
        for number, (attempt_id, _) in sorted(held.items()):
            if not any(a["id"] == attempt_id for a in by_slot.get(number, [])):
                problems.append(f"key {ident}: slot {number} held by {attempt_id}, which is not active on it")
    return problems


def _last_policy_changes() -> dict[str, datetime]:
    """When each namespace's key policies last changed (made, configured, retired)."""
    changed: dict[str, datetime] = {}
    for namespace_id, updated_at, retired_at in KeyPolicy.objects.values_list(
        "namespace_id", "updated_at", "retired_at"
    ):
        latest = max(updated_at, retired_at) if retired_at is not None else updated_at
        if namespace_id not in changed or latest > changed[namespace_id]:
            changed[namespace_id] = latest
    return changed


def _key_capacity_violations(active: Sequence[Mapping[str, Any]], policies: Mapping[str, PolicySet]) -> list[str]:
    """No grant exceeded the capacity in force: the k-th active attempt of a
    key, in lease order, was granted while the k − 1 before it held, so k is
    at most the capacity of its lease. A lowered capacity keeps its holders, so
    only leases made after the namespace's last policy change (and its settling
    time) are held to the rule in force now; a key without a policy ever made
    in its namespace is held to capacity 1 always."""
    problems: list[str] = []
    changed = _last_policy_changes()
    active_keyed: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for attempt in active:
        if attempt["concurrency_key"]:
            active_keyed[(attempt["namespace_id"], attempt["concurrency_key"])].append(attempt)
    for ident, attempts in sorted(active_keyed.items()):
        namespace_id, key = ident
        policy_set = policies.get(namespace_id)
        rule = policy_set.resolve(key) if policy_set is not None else read_policy_set(namespace_id).resolve(key)
        settled = changed.get(namespace_id)
        ordered = sorted(attempts, key=lambda a: (a["leased_at"], a["concurrency_token"] or 0))
        for index, attempt in enumerate(ordered, start=1):
            in_force = settled is None or attempt["leased_at"] > settled + POLICY_SETTLE
            if in_force and index > rule.capacity:
                problems.append(
                    f"key {ident}: attempt {attempt['id']} granted as permit {index} of capacity {rule.capacity}"
                )
            slot = attempt["concurrency_slot"]
            if in_force and slot is not None and int(slot) >= rule.capacity:
                problems.append(f"key {ident}: attempt {attempt['id']} on slot {slot} of capacity {rule.capacity}")
            if in_force and rule.capacity == 1 and slot is not None:
                problems.append(f"key {ident}: attempt {attempt['id']} has slot {slot} under capacity 1")
    return problems


def _slot_token_violations(
    active: Sequence[Mapping[str, Any]],
    holders: Mapping[tuple[str, str], ConcurrencyKey],
    slots: Mapping[tuple[str, str], list[ConcurrencySlot]],
) -> list[str]:
    """A slot's token is one its key issued (at most the key's version) and,
    while held, its holder's; the valid holders of a key hold distinct tokens."""
    problems: list[str] = []
    token_of = {a["id"]: a["concurrency_token"] for a in active}
    for ident, key_slots in sorted(slots.items()):
        row = holders.get(ident)
        for slot in key_slots:
            if row is None or slot.token > row.version:
                version = None if row is None else row.version
                problems.append(f"key {ident}: slot {slot.slot} token {slot.token} beyond the key's version {version}")
            if slot.holder_attempt_id in token_of and token_of[slot.holder_attempt_id] != slot.token:
                problems.append(
                    f"key {ident}: slot {slot.slot} token {slot.token} but its holder "
                    f"{slot.holder_attempt_id} has token {token_of[slot.holder_attempt_id]}"
                )
    tokens: dict[tuple[str, str], Counter[int]] = defaultdict(Counter)
    for attempt in active:
        if attempt["concurrency_key"] and attempt["concurrency_token"] is not None:
            tokens[(attempt["namespace_id"], attempt["concurrency_key"])][attempt["concurrency_token"]] += 1
    for ident, counted in sorted(tokens.items()):
        for token, times in sorted(counted.items()):
            if times > 1:
                problems.append(f"key {ident}: token {token} held by {times} active attempts")
    return problems


def key_rate_violations(
    active: Sequence[Mapping[str, Any]],
    holders: Mapping[tuple[str, str], ConcurrencyKey],
    policies: Mapping[str, PolicySet],
) -> list[str]:
    """A key's GCRA state against its attempts: rate_reserved counts its
    LEASED attempts that reserved a Start, and for a key whose rule has a rate
    its approved Starts since the namespace's last policy change keep the bound
    (count ≤ burst + t / T in every interval t): replayed through GCRA over the
    sorted started_at, with 1 ms of slack for rounding. A replay from an empty
    state is never stricter than the engine's, which also remembers the Starts
    before it."""
    problems: list[str] = []
    reserved: Counter[tuple[str, str]] = Counter(
        (a["namespace_id"], a["concurrency_key"])
        for a in active
        if a["concurrency_key"] and a["state"] == AttemptState.LEASED and a["key_rate_reserved"]
    )
    for ident in sorted(set(reserved) | set(holders)):
        row = holders.get(ident)
        expected = reserved.get(ident, 0)
        if row is not None and row.rate_reserved != expected:
            problems.append(f"key {ident}: rate_reserved={row.rate_reserved} but {expected} LEASED attempts reserved")
    changed = _last_policy_changes()
    for ident in sorted(holders):
        namespace_id, key = ident
        policy_set = policies.get(namespace_id)
        rule = policy_set.resolve(key) if policy_set is not None else None
        if rule is None or rule.rate is None:
            continue
        starts = Attempt.objects.filter(namespace_id=namespace_id, concurrency_key=key, started_at__isnull=False)
        settled = changed.get(namespace_id)
        if settled is not None:
            starts = starts.filter(started_at__gt=settled + POLICY_SETTLE)
        ordered = [
            (started_at, attempt_id)
            for started_at, attempt_id in starts.order_by("started_at").values_list("started_at", "id")
            if started_at is not None
        ]
        problems += _gcra_replay(ident, rule.rate, ordered)
    return problems


def _gcra_replay(ident: tuple[str, str], rate: Rate, starts: list[tuple[datetime, str]]) -> list[str]:
    tat: datetime | None = None
    for started_at, attempt_id in starts:
        if tat is not None and tat - rate.tolerance > started_at + RATE_TOLERANCE:
            allowed = (tat - rate.tolerance).isoformat()
            return [
                f"key {ident}: attempt {attempt_id} started at {started_at.isoformat()}, before its rate "
                f"({rate.starts}/{rate.per_seconds}s, burst {rate.burst}) allowed one ({allowed})"
            ]
        tat = rate.after_start(tat, started_at)
    return []


def _token_sequence_violations(holders: Mapping[tuple[str, str], ConcurrencyKey]) -> list[str]:
    """A key's row is its token sequence: it must exist wherever a token was
    issued (a new row would issue token 1 again) and be at or past the highest."""
    problems: list[str] = []
    issued = (
        Attempt.objects.exclude(concurrency_key="")
        .values_list("namespace_id", "concurrency_key")
        .annotate(highest=Max("concurrency_token"))
    )
    for namespace_id, key, highest in issued:
        row = holders.get((namespace_id, key))
        if row is None:
            problems.append(f"key {(namespace_id, key)}: tokens issued up to {highest} but it has no key row")
        elif highest is not None and highest > row.version:
            problems.append(f"key {(namespace_id, key)}: token {highest} issued beyond row version {row.version}")
    return problems


def placement_violations(cell: str) -> list[str]:
    """With cells, in the cell entered (`cell`): the directory places every
    application this cell holds here, or is moving it from or to here (a
    move copies before it switches and removes after). A placement here
    whose application has no rows yet is a creation cut short, which the
    next creation of that name completes: not drift."""
    placed_here = CellPlacement.objects.filter(Q(cell=cell) | Q(moving_to=cell) | Q(moving_from=cell))
    here = set(placed_here.values_list("application_id", flat=True))
    held = sorted(Application.objects.values_list("id", flat=True))
    elsewhere = {
        placement.application_id: placement.cell
        for placement in CellPlacement.objects.filter(application_id__in=[i for i in held if i not in here])
    }
    return [
        f"application {application_id}: in cell {cell} but the directory places it in {elsewhere[application_id]}"
        if application_id in elsewhere
        else f"application {application_id}: in cell {cell} but not in the directory"
        for application_id in held
        if application_id not in here
    ]


def event_cursor_violations() -> list[str]:
    """A namespace's event sequence row names its largest cursor (each writer
    advances it by exactly the events it inserts; a rollback undoes both)."""
    problems = []
    last = dict(EventSequence.objects.values_list("namespace_id", "last_seq"))
    for namespace_id, highest in Event.objects.values_list("namespace_id").annotate(top=Max("seq")):
        if last.get(namespace_id) != highest:
            sequence = last.get(namespace_id)
            problems.append(f"namespace {namespace_id}: events up to cursor {highest}, sequence at {sequence}")
    return problems


def state_row_violations() -> list[str]:
    """Every application and queue has its counter row (submits, leases and
    results lock it; without it they fail)."""
    problems = []
    counted = set(ApplicationState.objects.values_list("application_id", flat=True))
    for application_id in Application.objects.values_list("id", flat=True):
        if application_id not in counted:
            problems.append(f"application {application_id}: has no application_state row")
    counted = set(QueueState.objects.values_list("queue_id", flat=True))
    for queue_id in Queue.objects.values_list("id", flat=True):
        if queue_id not in counted:
            problems.append(f"queue {queue_id}: has no queue_state row")
    return problems


def plan_trigger_violations() -> list[str]:
    """A CREATED trigger names a task of its plan's queue (made in its
    transaction), and no task is made by two triggers."""
    problems = []
    made = list(PlanTrigger.objects.filter(outcome=TriggerOutcome.CREATED).values_list("id", "plan_id", "task_id"))
    queue_of_plan = dict(Plan.objects.values_list("id", "queue_id"))
    task_ids = [task_id for _, _, task_id in made]
    queue_of_task: dict[str, str] = {}
    for start in range(0, len(task_ids), 1000):  # bounded IN lists
        chunk = task_ids[start : start + 1000]
        queue_of_task.update(Task.objects.filter(id__in=chunk).values_list("id", "queue_id"))
    for trigger_id, plan_id, task_id in made:
        if queue_of_task.get(task_id) != queue_of_plan.get(plan_id):
            problems.append(f"plan {plan_id}: trigger {trigger_id} names task {task_id!r}, not a task of its queue")
    for task_id, count in Counter(t for _, _, t in made).items():
        if count > 1:
            problems.append(f"task {task_id}: made by {count} triggers")
    return problems


def capacity_violations(active: Sequence[Mapping[str, Any]]) -> list[str]:
    """No worker session holds more active attempts than the capacity its hello declared
    (whatever path gave them: a lease, a hand-off, a Start ahead, a replay)."""
    problems = []
    by_session = Counter((a["namespace_id"], a["worker_id"], a["session_id"]) for a in active)
    sessions = {
        (identity.namespace_id, identity.worker_id, identity.session_id): identity.capacity
        for identity in WorkerIdentity.objects.filter(capacity__gt=0).only(
            "namespace_id", "worker_id", "session_id", "capacity"
        )
    }
    for session, held in sorted(by_session.items()):
        capacity = sessions.get(session)
        if capacity is not None and held > capacity:
            problems.append(f"worker {session[1]!r} session {session[2]}: {held} active attempts, capacity {capacity}")
    return problems


def attempt_count_violations() -> list[str]:
    """A task's `attempts` is the number of its attempts that were started."""
    problems = []
    started = dict(
        Attempt.objects.filter(number__isnull=False)
        .values_list("task_id")
        .annotate(n=Count("id"))
        .values_list("task_id", "n")
    )
    counted = dict(Task.objects.filter(attempts__gt=0).values_list("id", "attempts"))
    for task_id in sorted(set(started) | set(counted)):
        expected, actual = started.get(task_id, 0), counted.get(task_id, 0)
        if expected != actual:
            problems.append(f"task {task_id}: attempts={actual} but {expected} attempts were started")
    return problems


def readiness_violations() -> list[str]:
    """Every (namespace, key, queue) with waiting tasks has exactly one ready;
    unkeyed tasks are always ready."""
    problems = []
    unready_unkeyed = Task.objects.filter(concurrency_key="", key_ready=False).count()
    if unready_unkeyed:
        problems.append(f"{unready_unkeyed} unkeyed tasks are not key_ready")
    groups = (
        Task.objects.filter(state=TaskState.WAITING)
        .exclude(concurrency_key="")
        .values("namespace_id", "concurrency_key", "queue_id")
        .annotate(ready=Count("id", filter=Q(key_ready=True)))
    )
    for group in groups:
        if group["ready"] != 1:
            problems.append(
                f"key {group['concurrency_key']!r} in queue {group['queue_id']}: {group['ready']} ready waiting tasks"
            )
    return problems


def token_order_violations() -> list[str]:
    """Per key, tokens strictly increase in lease order."""
    problems = []
    last: dict[tuple[str, str], tuple[int, str]] = {}
    keyed = (
        Attempt.objects.exclude(concurrency_key="")
        .order_by("namespace_id", "concurrency_key", "leased_at", "concurrency_token")
        .values_list("namespace_id", "concurrency_key", "concurrency_token", "id")
    )
    for namespace_id, key, token, attempt_id in keyed.iterator():
        ident = (namespace_id, key)
        if token is None:
            problems.append(f"key {ident}: attempt {attempt_id} has no token")
            continue
        previous = last.get(ident)
        if previous is not None and token <= previous[0]:
            problems.append(f"key {ident}: token {token} of {attempt_id} not above {previous[0]} of {previous[1]}")
        last[ident] = (token, attempt_id)
    return problems


# --- dependencies (SPEC §13) ------------------------------------------------


def _chunks(ids: Sequence[str]) -> list[list[str]]:
    ordered = sorted(ids)
    return [ordered[start : start + ID_CHUNK] for start in range(0, len(ordered), ID_CHUNK)]


def _edges_of(dependent_ids: Sequence[str]) -> dict[str, list[tuple[str, bool]]]:
    """Each dependent's edges (depends_on_id, settled), read through
    uniq_dependency_edge (task_id first)."""
    edges: dict[str, list[tuple[str, bool]]] = defaultdict(list)
    for chunk in _chunks(dependent_ids):
        rows = TaskDependency.objects.filter(task_id__in=chunk).values_list("task_id", "depends_on_id", "settled")
        for task_id, parent_id, settled in rows:
            edges[task_id].append((parent_id, settled))
    return edges


def _states_of(task_ids: Sequence[str]) -> dict[str, str]:
    states: dict[str, str] = {}
    for chunk in _chunks(task_ids):
        states.update(Task.objects.filter(id__in=chunk).values_list("id", "state"))
    return states


def dependency_violations() -> list[str]:
    """The dependency graph against its tasks, from two bounded reads: the
    unfinished tasks with dependencies (each queue's range of
    idx_task_dispatch, so it costs the backlog, not the history) and the tasks
    of the RECENT_LEASES newest leases (idx_attempt_leased); their edges by
    dependent (uniq_dependency_edge), their dependencies by primary key, the
    settlement rows (a finished task's fan-out still being settled) whole."""
    queue_ids = list(Queue.objects.values_list("id", flat=True))
    unfinished = (
        list(
            Task.objects.filter(
                queue_id__in=queue_ids, state__in=UNFINISHED_STATES, depends_on__isnull=False
            ).values_list("id", "state", "blocked_by", "on_dependency_failure", "depends_on")
        )
        if queue_ids
        else []
    )
    recent_ids = set(Attempt.objects.order_by("-leased_at").values_list("task_id", flat=True)[:RECENT_LEASES]) - {
        row[0] for row in unfinished
    }
    recent = [
        row
        for chunk in _chunks(list(recent_ids))
        for row in Task.objects.filter(id__in=chunk).values_list(
            "id", "state", "blocked_by", "on_dependency_failure", "depends_on"
        )
    ]
    # BLOCKED with no depends_on at all: no ending will ever move it (each queue's
    # BLOCKED range of idx_task_dispatch, which the rows above do not cover).
    problems = [
        f"task {task_id}: BLOCKED with no dependencies: nothing will move it"
        for task_id in (
            Task.objects.filter(queue_id__in=queue_ids, state=TaskState.BLOCKED, depends_on__isnull=True)
            .order_by("id")
            .values_list("id", flat=True)
            if queue_ids
            else []
        )
    ]
    pending = dict(DependencySettlement.objects.values_list("task_id", "created_at"))
    edges = _edges_of([row[0] for row in unfinished + recent if row[4]])
    parents = _states_of(sorted({parent for rows in edges.values() for parent, _ in rows}))
    problems += _dependent_violations(unfinished, edges, parents)
    problems += _ran_despite_failure_violations([row for row in recent if row[4]], edges, parents)
    # A finished dependency with unsettled edges and no settlement pending left
    # its dependents behind: from the unfinished dependents' edges, and each
    # recently run task probed as a dependency (idx_dependency_parent, settled = 0).
    suspects = {
        parent
        for rows in edges.values()
        for parent, settled in rows
        if not settled and parents.get(parent) in FINAL_TASK_STATES
    }
    suspects |= {row[0] for row in recent if row[1] in FINAL_TASK_STATES}
    problems += _left_behind_violations(sorted(suspects - set(pending)), {**parents, **{r[0]: r[1] for r in recent}})
    stuck_before = timezone.now() - SETTLEMENT_STUCK_AFTER
    for task_id, created_at in sorted(pending.items()):
        if created_at < stuck_before:
            problems.append(
                f"dependency {task_id}: settlement pending since {created_at.isoformat()}, "
                f"more than {SETTLEMENT_STUCK_AFTER.seconds} s: its follow-up is stuck"
            )
    return problems


DependentRow = tuple[str, str, int, str, Any]


def _dependent_violations(
    unfinished: Sequence[DependentRow], edges: Mapping[str, list[tuple[str, bool]]], parents: Mapping[str, str]
) -> list[str]:
    """An unfinished task with dependencies: BLOCKED exactly while it has
    unsettled edges, counting them in blocked_by; past BLOCKED only once
    every dependency finished, and never after a failed one under CANCEL."""
    problems: list[str] = []
    for task_id, state, blocked_by, on_failure, depends_on in unfinished:
        own = edges.get(task_id, [])
        if len(own) != len(depends_on):
            problems.append(f"task {task_id}: depends_on names {len(depends_on)} tasks but it has {len(own)} edges")
        for parent_id, _ in own:
            if parent_id not in parents:
                problems.append(f"task {task_id}: {state} but its dependency {parent_id} is gone")
        unsettled = [parent_id for parent_id, settled in own if not settled]
        if state == TaskState.BLOCKED:
            if not unsettled:
                problems.append(
                    f"task {task_id}: BLOCKED (blocked_by={blocked_by}) but all its dependency edges are "
                    "settled: nothing will move it"
                )
            elif blocked_by != len(unsettled):
                problems.append(
                    f"task {task_id}: BLOCKED with blocked_by={blocked_by} but {len(unsettled)} unsettled edges"
                )
            continue
        for parent_id, _ in own:
            parent_state = parents.get(parent_id)
            if parent_state is not None and parent_state not in FINAL_TASK_STATES:
                problems.append(f"task {task_id}: {state} before its dependency {parent_id} finished ({parent_state})")
        problems += _cancel_ignored(task_id, state, on_failure, own, parents)
    return problems


def _cancel_ignored(
    task_id: str, state: str, on_failure: str, own: list[tuple[str, bool]], parents: Mapping[str, str]
) -> list[str]:
    if on_failure != DependencyFailure.CANCEL:
        return []
    return [
        f"task {task_id}: {state} although its dependency {parent_id} ended {parents[parent_id]} "
        "under on_dependency_failure CANCEL"
        for parent_id, _ in own
        if parents.get(parent_id) in FAILED_STATES
    ]


def _ran_despite_failure_violations(
    recent: Sequence[DependentRow], edges: Mapping[str, list[tuple[str, bool]]], parents: Mapping[str, str]
) -> list[str]:
    """A task that was leased (it has an attempt) with a dependency that
    failed or was cancelled under CANCEL: a dependency's end is final, so it
    had ended before the lease, which must not have been."""
    problems: list[str] = []
    for task_id, state, _, on_failure, _ in recent:
        problems += _cancel_ignored(task_id, f"ran ({state})", on_failure, edges.get(task_id, []), parents)
    return problems


def _left_behind_violations(parent_ids: Sequence[str], states: Mapping[str, str]) -> list[str]:
    """Of these finished tasks with no settlement pending, those with
    unsettled edges: one range of idx_dependency_parent each (settled = 0
    holds only what is wrong), grouped by dependency."""
    problems: list[str] = []
    for chunk in _chunks(parent_ids):
        left = (
            TaskDependency.objects.filter(depends_on_id__in=chunk, settled=False)
            .values_list("depends_on_id")
            .annotate(edges=Count("id"), first=Min("task_id"))
            .values_list("depends_on_id", "edges", "first")
        )
        for parent_id, count, first in sorted(left):
            problems.append(
                f"dependency {parent_id}: ended {states.get(parent_id)} but {count} of its edges are unsettled "
                f"(task {first} first) and no settlement is pending: its dependents were left behind"
            )
    return problems

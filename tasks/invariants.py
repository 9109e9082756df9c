"""Recomputes every counter and permit from the rows and reports drift.

Used by `manage.py orbit_check`, the chaos harness and after every concurrent
test. Read-only."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from django.db import connection, transaction
from django.db.models import Count, Max, Q

from orbit.models import Application, ApplicationState, Event, EventSequence
from plans.models import Plan, PlanTrigger, TriggerOutcome
from queues.models import Queue, QueueState
from tasks.models import (
    ACTIVE_ATTEMPT_STATES,
    Attempt,
    AttemptState,
    ConcurrencyKey,
    Task,
    TaskState,
    WorkerIdentity,
)

UNFINISHED_STATES = [TaskState.WAITING, TaskState.LEASED, TaskState.RUNNING, TaskState.NEEDS_REVIEW]


def find_violations_in_snapshot() -> list[str]:
    """find_violations as of one instant, so it is exact while work goes on.

    At READ COMMITTED each query sees its own moment, and a commit between two
    of them looks like drift. On MySQL the checks run in one REPEATABLE READ
    transaction (one consistent snapshot); SQLite's read transaction already is one."""
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
    """The key rows against the attempts: their holders, their token sequences."""
    holders = {
        (row.namespace_id, row.key): row
        for row in ConcurrencyKey.objects.all().only("namespace_id", "key", "holder_attempt_id", "version")
    }
    return _key_holder_violations(active, holders) + _token_sequence_violations(holders)


def _key_holder_violations(
    active: Sequence[Mapping[str, Any]], holders: Mapping[tuple[str, str], ConcurrencyKey]
) -> list[str]:
    """One holder at most, and the holder is exactly the active keyed attempt."""
    problems: list[str] = []
    active_keyed = defaultdict(list)
    for attempt in active:
        if attempt["concurrency_key"]:
            active_keyed[(attempt["namespace_id"], attempt["concurrency_key"])].append(attempt["id"])
    for ident, attempt_ids in active_keyed.items():
        if len(attempt_ids) > 1:
            problems.append(f"key {ident}: {len(attempt_ids)} active permits")
        row = holders.get(ident)
        if row is None or row.holder_attempt_id not in attempt_ids:
            problems.append(f"key {ident}: active attempt {attempt_ids} is not the row's holder")
    for ident, row in holders.items():
        if row.holder_attempt_id and ident not in active_keyed:
            problems.append(f"key {ident}: held by {row.holder_attempt_id}, which is not active")
    return problems


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

"""Dispatch: the lease and Start parts of a round (lease, peek_starts,
apply_starts), and the standalone transactions of the worker protocol
(renew_lease, resume_attempt, held_assignments, held_attempt_ids). The
single-item doors (lease_tasks, approve_start) are in tasks.actions.rounds."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from django.utils import timezone

from orbit.audit import emit_event
from orbit.db.rows import (
    Add,
    Pk,
    add_to_row,
    insert_rows,
    lock_by_pk_together,
    new_row,
    read_by_pk,
    select_rows,
    update_by_pk,
    update_each_by_pk,
)
from orbit.errors import KEY_RATE_REACHED, LeaseLost, OrbitError, QueuePaused, RateLimited, TaskCancelled
from orbit.metrics import ATTEMPTS_LEASED, ATTEMPTS_STARTED
from orbit.models import ApplicationState
from orbit.timefmt import format_time
from orbit.transactions import outermost
from queues.locks import lock_queue_states
from queues.models import Queue, QueueState
from tasks import sql
from tasks.actions import fairness, rollup
from tasks.actions.context import (
    LEASE_BATCH_MAX,
    LEASE_PASSES,
    RATE_WINDOW,
    Configuration,
    WorkerContext,
    application_room,
    candidate_filter,
    concurrency_room,
    deadline_failure,
    key_refusal,
    lease_expiry,
    queue_closed,
    rate_room,
    refuse_revoked,
    serves,
    window_open,
    window_reopens_at,
    window_used,
)
from tasks.actions.dependencies import attach_dependencies
from tasks.actions.readiness import NextInLine, hand_on, next_in_line
from tasks.actions.serialize import assignment
from tasks.key_rules import KeyRule, PolicySet, cache_rule
from tasks.locks import lock_application_state, lock_attempt, lock_concurrency_keys, lock_slots
from tasks.models import (
    ACTIVE_ATTEMPT_STATES,
    Attempt,
    AttemptState,
    ConcurrencyKey,
    ConcurrencySlot,
    Task,
    TaskState,
    started_with_its_lease,
)


@dataclass(frozen=True)
class LeaseOutcome:
    assignments: list[dict[str, Any]]
    # Seconds until a queue's full start window closes and leasing may resume
    # (None when no queue was held back by its start rate).
    rate_reopens_in: float | None = None
    # Whether a leasable candidate was left when the lease stopped (at its
    # limits): False says the worker's queues had nothing more for it.
    more: bool = False


def _candidates(worker: WorkerContext, queue_id: str, now: datetime, count: int) -> list[Task]:
    """The best `count` leasable tasks of a queue for this worker, locked,
    skipping rows another lease holds."""
    where, params = candidate_filter(worker, queue_id, now)
    return select_rows(Task, f"{where} {sql.LEASE_ORDER} LIMIT %s", [*params, count], lock=True, skip_locked=True)


def lease(
    requests: list[tuple[WorkerContext, int]],
    configuration: Configuration,
    *,
    starting: Sequence[tuple[str, str] | None] | None = None,
    started_only: Sequence[bool] | None = None,
) -> list[LeaseOutcome]:
    """Leases for several workers of one kind (same namespace, queues, handlers
    and key opt-in) at once: up to its limit (at most LEASE_BATCH_MAX) for each,
    filled in request order, those that start ahead first. Caller holds the
    transaction. One candidate scan,
    one set of counter writes, however many workers asked.

    `starting[i]`: request i's worker sent its Start ahead (task.result's
    start_next), from a task of this handler and version: each attempt it
    leases that its worker serves for sure (a task of that same pair, or any,
    for a worker that listed its handlers) is also started here, under every
    check of a Start, and its assignment says so (`state` RUNNING and
    `attempt_number`, as a held entry). Any other, and one a Start would
    refuse now (its queue's rate window full, a deadline passed), goes out
    unstarted, for the worker's own task.start. `started_only[i]`: request i
    takes only what it starts ahead (a hand-off past its connection's bound on
    unacknowledged assignments); a task it could not start goes to the next
    request, and its slot stays free for its dispatcher (the outcome's `more`).

    A scan sees one ready task per key and queue (tasks.actions.readiness):
    when the lease took a key that has permits left (capacity above 1) and is
    not full, it scans again, up to LEASE_PASSES times, and the ready role it
    handed on is taken too."""
    limits = [max(0, min(limit, LEASE_BATCH_MAX)) for _, limit in requests]
    outcomes = [LeaseOutcome([]) for _ in requests]
    served: list[Task] = []  # the leased tasks of fair queues, in lease order
    for _ in range(LEASE_PASSES):
        if sum(limits) <= 0:
            break
        passed, again = _lease_pass(requests, limits, configuration, starting, started_only, served)
        outcomes = [
            LeaseOutcome(
                [*done.assignments, *now.assignments],
                _sooner(done.rate_reopens_in, now.rate_reopens_in),
                now.more,
            )
            for done, now in zip(outcomes, passed, strict=True)
        ]
        if not again:
            break
        limits = [limit - len(now.assignments) for limit, now in zip(limits, passed, strict=True)]
    # Once, after every pass has locked its tasks (the fair share rows come after them).
    fairness.record_served(served, timezone.now())
    return outcomes


def _lease_pass(
    requests: list[tuple[WorkerContext, int]],
    limits: list[int],
    configuration: Configuration,
    starting: Sequence[tuple[str, str] | None] | None,
    started_only: Sequence[bool] | None,
    served: list[Task],
) -> tuple[list[LeaseOutcome], bool]:
    """One pass of lease(), and whether another could take more (a key it
    took has permits left and the lease is not full).

    In steps: the application's room, the queues' room, the candidates, their
    key permits, then each candidate in lease order is taken (its key's token,
    its attempt, its Start ahead) until the lease is full; the writes last."""
    worker = requests[0][0]  # what the kind shares
    app_state = lock_application_state(worker.application_id)
    # Read the clock after the lock: leases of one application are serialized
    # here, so lease times follow token order.
    now = timezone.now()
    application = configuration.application(worker.application_id)
    want = min(sum(limits), application_room(application, app_state.active_attempts))
    if want <= 0:
        return [LeaseOutcome([]) for _ in requests], False
    states = lock_queue_states(worker.queue_ids)
    queues = {queue.id: queue for queue in configuration.queues_of(states) if queue.namespace_id == worker.namespace_id}
    headroom, rate_reopens_in = _queue_room(queues.values(), states, now)
    if not headroom:
        return [LeaseOutcome([], rate_reopens_in) for _ in requests], False
    fair_queues = {queue_id for queue_id in headroom if states[queue_id].fair_shares}
    fair = bool(fair_queues)
    candidates, more = _best_candidates(worker, headroom, want, now, states, fair)
    policies = configuration.key_policies(worker.application_id, worker.namespace_id)
    permits = _KeyPermits.lock(worker, candidates, policies, now, fair_queues, served)
    # In lease order, once the keys are read: a ready keyed task stands in for
    # the sibling that overtook it (next_in_line), ranked as what it leases.
    candidates.sort(key=lambda task: _lease_rank(permits.stand_in(task), fair, task))
    successors_priority: int | None = None
    taking = _Taking(
        requests,
        list(starting or [None] * len(requests)),
        list(started_only or [False] * len(requests)),
        limits,
        headroom,
        states,
        queues,
        now,
    )
    for task in candidates:
        if len(taking.chosen) >= want:
            more = True
            break
        if successors_priority is not None and permits.stand_in(task).priority < successors_priority:
            # A key taken in this pass has a permit left for its next task, of
            # a higher priority than this one: the next pass sees that task
            # ready. (At equal priority the pass goes on, other keys' younger
            # tasks before the older next task: a pass per permit would cut a
            # lease of a capacity-4 key's work to a few tasks.)
            more = True
            break
        if taking.queue_full(task.queue_id):
            continue
        turn = permits.turn(task, worker)
        if turn is not None and not taking.take(turn, permits):
            more = True  # every request left passed it over: its dispatcher's to lease
            break
        successor = permits.leasable_successor(turn, worker) if turn is not None else None
        if successor is not None and not taking.queue_full(successor.queue_id):
            successors_priority = max(successors_priority or 0, successor.priority)
    if policies.rated and len(taking.chosen) < want:
        rate_reopens_in = _sooner(rate_reopens_in, _next_key_start_in(worker.namespace_id, now))
    if not taking.chosen:
        permits.write()
        return [LeaseOutcome([], rate_reopens_in, more) for _ in requests], False
    taking.write(worker.application_id, permits)
    served += [task for task, _ in taking.chosen if states[task.queue_id].fair_shares]
    again = len(taking.chosen) < want and permits.room_left(taking.chosen)
    return [LeaseOutcome(entries, rate_reopens_in, more) for entries in taking.assignments], again


def _lease_rank(task: Task, fair: bool, scanned: Task) -> tuple[Any, ...]:
    """A task's place in the lease order (SPEC §7: higher priority first, then
    the oldest available); beside a fair queue, the fair round robin's rank of
    the task the scan read (`scanned`) stands in for the rest."""
    if not fair:
        return (-task.priority, task.available_at, task.id)
    return (-task.priority, scanned.fair_rank)


def _sooner(seconds: float | None, other: float | None) -> float | None:
    return other if seconds is None else seconds if other is None else min(seconds, other)


def _next_key_start_in(namespace_id: str, now: datetime) -> float | None:
    """Seconds until the namespace's next rate-limited key may lease again
    (idx_ckey_ns_next_start), so a dispatcher held back by a key's rate comes
    back then instead of at its next poll."""
    soonest = (
        ConcurrencyKey.objects.filter(namespace_id=namespace_id, next_start_at__gt=now)
        .order_by("next_start_at")
        .values_list("next_start_at", flat=True)
        .first()
    )
    return None if soonest is None else (soonest - now).total_seconds()


def _queue_room(
    queues: Iterable[Queue], states: dict[str, QueueState], now: datetime
) -> tuple[dict[str, int], float | None]:
    """How many attempts each open queue may lease now (those with room: the
    smaller of its free permits and its start window's room), and the seconds
    until the first queue held back by a full start window reopens (None when
    no queue is)."""
    headroom: dict[str, int] = {}
    rate_reopens_in: float | None = None
    for queue in queues:
        if queue_closed(queue):
            continue
        state = states[queue.id]
        start_room = rate_room(queue, state, now)
        room = min(concurrency_room(queue, state), start_room)
        reopens_at = window_reopens_at(state)
        if room > 0:
            headroom[queue.id] = room
        elif start_room <= 0 and window_used(state, now) and reopens_at is not None:
            reopens = (reopens_at - now).total_seconds()
            rate_reopens_in = reopens if rate_reopens_in is None else min(rate_reopens_in, reopens)
    return headroom, rate_reopens_in


def _best_candidates(
    worker: WorkerContext,
    headroom: dict[str, int],
    want: int,
    now: datetime,
    states: dict[str, QueueState],
    fair: bool,
) -> tuple[list[Task], bool]:
    """The leasable tasks of the queues with room, locked (at most what the
    lease and each queue may take, and one more each), and whether a queue
    had more; the caller puts them in lease order (_lease_rank).

    With a fair queue among them (`fair`), a queue whose tasks carry fairness
    keys is ranked round robin between them (tasks.actions.fairness); beside
    it, a plain queue's tasks are one group never served."""
    candidates: list[Task] = []
    more = False  # a leasable candidate left over
    for queue_id, room in sorted(headroom.items()):
        take = min(want, room)
        # One row more than may be taken, to know whether there is more (only
        # counted: its row stays locked until the commit, and nothing else).
        if states[queue_id].fair_shares:
            found = fairness.fair_candidates(worker, queue_id, now, take + 1)
        else:
            found = _candidates(worker, queue_id, now, take + 1)
            if fair:
                fairness.rank_as_one_group(found)
        more = more or len(found) > take
        # The row read past the queue's share too: a keyed candidate refused
        # (its key taken by another queue's task in this lease) leaves the
        # queue's room to it, where the walk's queue_full keeps the share.
        candidates.extend(found)
    return candidates, more


@dataclass(frozen=True)
class _Turn:
    """A candidate the lease may take: `task` (the ready task, or the sibling
    that took its key's turn), its key row when keyed, and what followed it
    in its key's line."""

    task: Task
    key_row: ConcurrencyKey | None = None
    line: NextInLine | None = None


# The key row's columns a lease that took it writes, and those its rule sets
# (tasks.key_rules.cache_rule, the rate's reservation), written when changed.
HOLDER_COLUMNS = ("version", "holder_attempt_id", "holder_task_id", "holders", "updated_at")
RULE_COLUMNS = ("capacity", "rate_tat", "rate_reserved", "next_start_at")


def _rule_columns(row: ConcurrencyKey) -> tuple[Any, ...]:
    return tuple(getattr(row, name) for name in RULE_COLUMNS)


@dataclass
class _KeyPermits:
    """The key rows of the lease's keyed candidates, locked, with the rule
    each has now (tasks.key_rules), the slot rows of those with capacity
    above 1, and each free key's line (next_in_line)."""

    namespace_id: str
    rows: dict[str, ConcurrencyKey]
    rules: dict[str, KeyRule]
    slots: dict[str, dict[int, ConcurrencySlot]]
    lines: dict[str, NextInLine]
    now: datetime
    # Each row's rule columns as locked: a write sends only those that changed
    # (a key without a policy never changes them).
    as_locked: dict[str, tuple[Any, ...]]
    taken: set[str] = field(default_factory=set)  # key rows this lease gave a permit of
    granted: list[ConcurrencySlot] = field(default_factory=list)  # slot rows this lease gave out

    @classmethod
    def lock(
        cls,
        worker: WorkerContext,
        candidates: list[Task],
        policies: PolicySet,
        now: datetime,
        fair_queues: set[str],
        served: list[Task],
    ) -> _KeyPermits:
        namespace_id = worker.namespace_id
        rows = lock_concurrency_keys(namespace_id, [t.concurrency_key for t in candidates if t.concurrency_key])
        rules = {key: policies.resolve(key) for key in rows}
        as_locked = {key: _rule_columns(row) for key, row in rows.items()}
        for key, locked in rows.items():
            cache_rule(locked, rules[key], now)
        free = [
            task
            for task in candidates
            if (row := rows.get(task.concurrency_key)) is not None
            and key_refusal(row, rules[task.concurrency_key], now) is None
        ]
        slotted = sorted({task.concurrency_key for task in free if rules[task.concurrency_key].capacity > 1})
        slots = lock_slots(namespace_id, slotted)
        return cls(namespace_id, rows, rules, slots, next_in_line(free, now, fair_queues, served), now, as_locked)

    def turn(self, task: Task, worker: WorkerContext) -> _Turn | None:
        """Whose turn a candidate is: its own, an overtaking sibling's, or (None)
        nobody's in this lease."""
        if not task.concurrency_key:
            return _Turn(task)
        key_row = self.rows.get(task.concurrency_key)
        if key_row is None:
            return None  # never lease a keyed task without its key permit
        if key_refusal(key_row, self.rules[task.concurrency_key], self.now) is not None:
            # Every permit held (by a twin in this batch or a lease that won
            # the race), no start room, or the token space is spent: refuse
            # rather than wrap.
            return None
        leased = self.stand_in(task)
        if leased is not task and not serves(worker.handlers, leased):
            return None  # the key's turn is the sibling's, for a worker that serves it
        return _Turn(leased, key_row, self.lines.get(task.id))

    def stand_in(self, task: Task) -> Task:
        """The task a candidate leases if its turn comes: the sibling that
        overtook it, or itself."""
        line = self.lines.get(task.id)
        overtaker = line.overtaker if line is not None else None
        return task if overtaker is None else overtaker

    def leasable_successor(self, turn: _Turn, worker: WorkerContext) -> Task | None:
        """After `turn` was taken: its key's next task when the key still has a
        permit for it now and this worker serves it (a capacity above 1)."""
        successor = turn.line.successor if turn.line is not None else None
        if successor is None or turn.key_row is None:
            return None
        rule = self.rules[turn.key_row.key]
        if rule.capacity <= 1 or key_refusal(turn.key_row, rule, self.now) is not None:
            return None
        if not serves(worker.handlers, successor):
            return None
        return successor

    def grant(self, key_row: ConcurrencyKey, task: Task, attempt: Attempt, now: datetime) -> None:
        """Gives the attempt a permit of the key, in memory: the lowest slot
        whose last holder ended (capacity above 1; slot 0 is the row's own
        holder), or the row's one permit (capacity 1: no slot, as the seed)."""
        rule = self.rules[key_row.key]
        slot = None if rule.capacity == 1 else self._free_slot(key_row, rule.capacity)
        attempt.concurrency_slot = slot
        key_row.holders += 1
        key_row.updated_at = now
        if not slot:
            key_row.holder_attempt_id = attempt.id
            key_row.holder_task_id = task.id
            return
        found = self.slots.setdefault(key_row.key, {}).get(slot)
        if found is None:
            found = ConcurrencySlot(namespace_id=key_row.namespace_id, key=key_row.key, slot=slot)
            self.slots[key_row.key][slot] = found
        found.holder_attempt_id, found.holder_task_id = attempt.id, task.id
        found.token = attempt.concurrency_token or 0
        found.updated_at = now
        self.granted.append(found)

    def _free_slot(self, key_row: ConcurrencyKey, capacity: int) -> int:
        if not key_row.holder_attempt_id:
            return 0
        held = self.slots.get(key_row.key, {})
        # One of 1…N−1 is free: holders < capacity, and every held slot counts in holders.
        return next(slot for slot in range(1, capacity) if slot not in held or not held[slot].holder_attempt_id)

    def room_left(self, chosen: list[tuple[Task, Attempt]]) -> bool:
        """Whether a key of these taken tasks with capacity above 1 could still grant now."""
        keys = {task.concurrency_key for task, _ in chosen if task.concurrency_key}
        return any(
            self.rules[key].capacity > 1 and key_refusal(self.rows[key], self.rules[key], self.now) is None
            for key in keys
        )

    def write(self) -> None:
        """The key rows this lease took (their token, holders and rule
        columns) or only recached (the rule columns the scan filters on), and
        the slot rows it granted: one statement for the rows, one per kind of
        slot write."""
        names: dict[str, list[str]] = {}
        for key, row in self.rows.items():
            rule_changes = [
                name for name, was in zip(RULE_COLUMNS, self.as_locked[key], strict=True) if getattr(row, name) != was
            ]
            if key in self.taken:
                names[key] = [*HOLDER_COLUMNS, *rule_changes]
            elif rule_changes:
                names[key] = rule_changes
        # One UPDATE names the same columns for every row: the union of theirs.
        written = list(dict.fromkeys(name for key_names in names.values() for name in key_names))
        rows: dict[Pk, dict[str, Any]] = {
            self.rows[key].pk: {name: getattr(self.rows[key], name) for name in written} for key in names
        }
        update_each_by_pk(ConcurrencyKey, rows)
        granted = list({id(slot): slot for slot in self.granted}.values())
        insert_rows([slot for slot in granted if slot.pk is None])
        update_each_by_pk(
            ConcurrencySlot,
            {
                slot.pk: {
                    "holder_attempt_id": slot.holder_attempt_id,
                    "holder_task_id": slot.holder_task_id,
                    "token": slot.token,
                    "updated_at": slot.updated_at,
                }
                for slot in granted
                if slot.pk is not None
            },
        )


class _Taking:
    """What a lease takes, candidate by candidate, and writes at its end."""

    def __init__(
        self,
        requests: list[tuple[WorkerContext, int]],
        starting: list[tuple[str, str] | None],
        started_only: list[bool],
        limits: list[int],
        headroom: dict[str, int],
        states: dict[str, QueueState],
        queues: dict[str, Queue],
        now: datetime,
    ) -> None:
        self.requests, self.starting, self.started_only, self.headroom = requests, starting, started_only, headroom
        self.states, self.queues, self.now = states, queues, now
        self.chosen: list[tuple[Task, Attempt]] = []
        self.started: list[tuple[Task, Attempt]] = []  # of those chosen, the ones started ahead
        self.handed_on: list[tuple[Task, NextInLine | None]] = []  # keyed tasks chosen, each with what followed it
        self.per_queue: dict[str, int] = {}
        self.assignments: list[list[dict[str, Any]]] = [[] for _ in requests]
        self.entries: list[tuple[Task, dict[str, Any]]] = []  # every assignment with its task
        # Which request the next attempt goes to: each is filled up to its limit in
        # turn, those that start what they take first (a hand-off, whose result
        # asked for its next Start: the released key goes on with it; another
        # request would take it unstarted, to be started in a round of its own).
        order = sorted(range(len(requests)), key=lambda index: starting[index] is None)
        self.takers = iter([index for index in order for _ in range(limits[index])])

    def _taker(self, turn: _Turn, rule: KeyRule | None) -> tuple[int, bool] | None:
        """The request the turn's task goes to, and whether it starts the task
        there (_would_start_ahead): the next slot's, passing over the slot of a
        started-only request that would not start it (the slot stays free);
        None when no slot is left."""
        task = turn.task
        state, queue = self.states[task.queue_id], self.queues[task.queue_id]
        for taker in self.takers:
            served, holder = self.starting[taker], self.requests[taker][0]
            starts = _would_start_ahead(served, holder, task, state, queue, self.now, turn.key_row, rule)
            if starts or not self.started_only[taker]:
                return taker, starts
        return None

    def queue_full(self, queue_id: str) -> bool:
        return self.per_queue.get(queue_id, 0) >= self.headroom[queue_id]

    def take(self, turn: _Turn, permits: _KeyPermits) -> bool:
        """Leases the turn's task to the next request: its key's next token
        and permit, its attempt, and its Start when its worker sent that
        ahead (else, under a key's rate, the Start's room it reserves).
        False, taking nothing, when no request is left to take it."""
        task, key_row, now = turn.task, turn.key_row, self.now
        rule = permits.rules[key_row.key] if key_row is not None else None
        chosen = self._taker(turn, rule)
        if chosen is None:
            return False
        taker, starts = chosen
        token = None
        if key_row is not None:
            self.handed_on.append((task, turn.line))
            key_row.version += 1
            token = key_row.version
        holder = self.requests[taker][0]
        attempt = _new_attempt(task, holder, token, now)
        if key_row is not None:
            permits.grant(key_row, task, attempt, now)
        task.state = TaskState.LEASED
        task.updated_at = now
        self.chosen.append((task, attempt))
        if starts:
            _count_start(task, attempt, self.states[task.queue_id], now, key_row, rule)
            self.started.append((task, attempt))
            entry = held_entry(task, attempt)
        else:
            if key_row is not None and rule is not None and rule.rate is not None:
                key_row.rate_reserved += 1
                attempt.key_rate_reserved = True
            entry = assignment(task, attempt)
        self.assignments[taker].append(entry)
        self.entries.append((task, entry))
        if key_row is not None and rule is not None:
            cache_rule(key_row, rule, now)
            permits.taken.add(key_row.key)
        self.per_queue[task.queue_id] = self.per_queue.get(task.queue_id, 0) + 1
        return True

    def write(self, application_id: str, permits: _KeyPermits) -> None:
        """The lease's writes: its attempts, key and slot rows, tasks, the
        ready roles it hands on, the counters, events and metrics."""
        chosen, started, now = self.chosen, self.started, self.now
        insert_rows([attempt for _, attempt in chosen])
        permits.write()
        attach_dependencies(self.entries)
        # Every chosen task was locked WAITING at its epoch: one statement moves
        # those leased, one those also started.
        started_ids = {task.id for task, _ in started}
        update_by_pk(
            Task,
            [task.id for task, _ in chosen if task.id not in started_ids],
            {"state": TaskState.LEASED, "epoch": Add(1), "updated_at": now},
        )
        update_by_pk(
            Task,
            sorted(started_ids),
            {"state": TaskState.RUNNING, "epoch": Add(1), "attempts": Add(1), "updated_at": now},
        )
        # Each keyed one was its key's ready task in its queue: hand the role on.
        hand_on(self.handed_on, now)
        add_to_row(ApplicationState, application_id, {"active_attempts": len(chosen)})
        started_per_queue = Counter(task.queue_id for task, _ in started)
        for queue_id, count in sorted(self.per_queue.items()):
            add_to_row(
                QueueState, queue_id, {"active_permits": count, "reserved_starts": count - started_per_queue[queue_id]}
            )
        _emit_moves([task for task, _ in chosen], TaskState.LEASED, previous=TaskState.WAITING)
        ATTEMPTS_LEASED.inc(len(chosen))
        if started:
            _count_starts(started, started_per_queue, self.states, now)


def _new_attempt(task: Task, holder: WorkerContext, token: int | None, now: datetime) -> Attempt:
    """The LEASED attempt of a task for its holder, at the task's next epoch."""
    task.epoch += 1
    return new_row(
        Attempt,
        task_id=task.id,
        namespace_id=task.namespace_id,
        application_id=task.application_id,
        queue_id=task.queue_id,
        state=AttemptState.LEASED,
        epoch=task.epoch,
        concurrency_key=task.concurrency_key,
        concurrency_token=token,
        worker_id=holder.worker_id,
        session_id=holder.session_id,
        leased_at=now,
        lease_expires_at=lease_expiry(task, now),
    )


def _would_start_ahead(
    served: tuple[str, str] | None,
    holder: WorkerContext,
    task: Task,
    state: QueueState,
    queue: Queue,
    now: datetime,
    key_row: ConcurrencyKey | None,
    rule: KeyRule | None,
) -> bool:
    """Whether the lease starts this task, changing nothing: its worker sent
    its Start ahead (`served`: the handler and version it evidently serves)
    and serves this task for sure, and a Start of the LEASED attempt within
    its lease would be approved now (what _start_one decides; the lease has
    checked the queue is open): no deadline passed, nothing that refuses a
    Start (_start_refusal). Else the assignment goes out unstarted and the
    worker sends its own Start."""
    if served is None or not (holder.handlers or (task.handler, task.handler_version) == served):
        return False
    return deadline_failure(task, now) is None and _start_refusal(state, queue, now, key_row, rule) is None


def _emit_moves(tasks: list[Task], state: str, *, previous: str) -> None:
    """One task.state_changed event per task (a round gathers them into one insert)."""
    for task in tasks:
        emit_event(
            namespace_id=task.namespace_id,
            type="task.state_changed",
            subject_id=task.id,
            data={"queue_id": task.queue_id, "state": state, "previous": previous},
        )


def _peek_own_attempt(worker: WorkerContext, attempt_id: str) -> Attempt:
    attempt = Attempt.objects.filter(id=attempt_id, namespace_id=worker.namespace_id).first()
    if attempt is None or not worker.owns_attempt(attempt):
        raise LeaseLost("attempt is not held by this worker")
    return attempt


def _start_receipt(attempt: Attempt) -> dict[str, Any]:
    return {"attempt_number": attempt.number, "lease_expires_at": format_time(attempt.lease_expires_at)}


@dataclass(frozen=True)
class StartRequest:
    worker: WorkerContext
    attempt_id: str
    epoch: int


def peek_starts(
    requests: list[StartRequest], rows: dict[str, Attempt] | None = None
) -> tuple[list[dict[str, Any] | LeaseLost | None], dict[str, Attempt]]:
    """The unlocked first reads of Starts (from `rows`, when the caller read
    them already): an answer for each request that needs no transaction (not
    held, wrong epoch, replay of a running attempt), None for the others; and
    the peeked attempts."""
    peeks = read_by_pk(Attempt, [request.attempt_id for request in requests]) if rows is None else rows
    answers: list[dict[str, Any] | LeaseLost | None] = []
    for request in requests:
        peek, worker = peeks.get(request.attempt_id), request.worker
        if peek is None or not worker.owns_attempt(peek):
            answers.append(LeaseLost("attempt is not held by this worker"))
        elif peek.epoch != request.epoch:
            answers.append(LeaseLost("epoch does not match the current lease"))
        elif peek.state == AttemptState.RUNNING:
            answers.append(_start_receipt(peek))
        else:
            answers.append(None)
    return answers, peeks


class DeadlinePassed(Exception):
    pass


def start_key_rules(peeks: Iterable[Attempt], configuration: Configuration) -> dict[tuple[str, str], KeyRule]:
    """The keys whose rows these Starts lock, by (namespace, key), with each
    key's rule: a key with a start rate now (its Start counts in the key's
    GCRA state), or whose lease reserved a Start's room (given back now).
    Other Starts lock no key row, as before policies."""
    found: dict[tuple[str, str], KeyRule] = {}
    for peek in peeks:
        if not peek.concurrency_key:
            continue
        policies = configuration.key_policies(peek.application_id, peek.namespace_id)
        if policies.empty and not peek.key_rate_reserved:
            continue
        rule = policies.resolve(peek.concurrency_key)
        if rule.rate is not None or peek.key_rate_reserved:
            found[(peek.namespace_id, peek.concurrency_key)] = rule
    return found


def apply_starts(
    requests: list[StartRequest], peeks: dict[str, Attempt], configuration: Configuration
) -> list[dict[str, Any] | OrbitError | DeadlinePassed]:
    """Decides Starts (peeked by peek_starts) under their locks; caller holds the
    transaction. One outcome per request."""
    states = lock_queue_states(peeks[request.attempt_id].queue_id for request in requests)
    rules = start_key_rules([peeks[request.attempt_id] for request in requests], configuration)
    key_rows: dict[tuple[str, str], ConcurrencyKey] = {}
    for namespace_id in sorted({namespace_id for namespace_id, _ in rules}):
        locked = lock_concurrency_keys(namespace_id, [key for ns, key in rules if ns == namespace_id])
        key_rows.update(((namespace_id, key), row) for key, row in locked.items())
    tasks, attempts = lock_by_pk_together(  # tasks → attempts, one round trip
        [
            (Task, [peeks[request.attempt_id].task_id for request in requests]),
            (Attempt, [request.attempt_id for request in requests]),
        ]
    )
    # Read the clock after the locks: a Start that waited on them must judge
    # its lease and the rate window by the time it is decided, not queued.
    now = timezone.now()
    queues = {queue.id: queue for queue in configuration.queues_of(states)}
    started: list[tuple[Task, Attempt]] = []
    outcomes: list[dict[str, Any] | OrbitError | DeadlinePassed] = []
    for request in requests:
        peek = peeks[request.attempt_id]
        task, attempt = tasks.get(peek.task_id), attempts.get(peek.id)
        keyed = (peek.namespace_id, peek.concurrency_key)
        key = (key_rows.get(keyed), rules.get(keyed))
        try:
            outcomes.append(
                _start_one(request, task, attempt, states[peek.queue_id], queues[peek.queue_id], now, started, key)
            )
        except (OrbitError, DeadlinePassed) as refusal:  # raised before this request changed anything
            outcomes.append(refusal)
    if not started:
        return outcomes
    update_each_by_pk(
        ConcurrencyKey,
        {
            row.pk: {"rate_tat": row.rate_tat, "rate_reserved": row.rate_reserved, "next_start_at": row.next_start_at}
            for row in key_rows.values()
        },
    )
    per_queue = Counter(task.queue_id for task, _ in started)
    for queue_id, count in sorted(per_queue.items()):
        update_by_pk(QueueState, [queue_id], {"reserved_starts": Add(-count)})
    # Started tasks were locked LEASED: one statement moves them all; attempts
    # differ only in number and lease end, so one statement per distinct pair.
    update_by_pk(
        Task, [task.id for task, _ in started], {"state": TaskState.RUNNING, "attempts": Add(1), "updated_at": now}
    )
    alike: dict[tuple[int | None, datetime], list[str]] = {}
    for _, attempt in started:
        alike.setdefault((attempt.number, attempt.lease_expires_at), []).append(attempt.id)
    for (number, lease_expires_at), attempt_ids in alike.items():
        update_by_pk(
            Attempt,
            attempt_ids,
            {
                "state": AttemptState.RUNNING,
                "number": number,
                "started_at": now,
                "lease_expires_at": lease_expires_at,
            },
        )
    _count_starts(started, per_queue, states, now)
    return outcomes


def _count_starts(
    started: list[tuple[Task, Attempt]], per_queue: Counter[str], states: dict[str, QueueState], now: datetime
) -> None:
    """What every approved Start leaves besides its task and attempt: its
    queue's rate window (as _approve_start moved it), the per-minute count,
    the LEASED → RUNNING event, the metric."""
    for queue_id, count in sorted(per_queue.items()):
        state = states[queue_id]
        update_by_pk(
            QueueState,
            [queue_id],
            {"window_started_at": state.window_started_at, "window_count": state.window_count},
        )
        rollup.count("starts", queue_id, now, count)
    _emit_moves([task for task, _ in started], TaskState.RUNNING, previous=TaskState.LEASED)
    ATTEMPTS_STARTED.inc(len(started))


def _start_one(
    request: StartRequest,
    task: Task | None,
    attempt: Attempt | None,
    state: QueueState,
    queue: Queue,
    now: datetime,
    started: list[tuple[Task, Attempt]],
    key: tuple[ConcurrencyKey | None, KeyRule | None] = (None, None),
) -> dict[str, Any]:
    """Decides one Start under the group's locks. The queue state (and a key
    row under a rate) is shared by the group: each approval counts in the
    window the next one sees."""
    if task is None or attempt is None:
        raise LeaseLost("attempt is not held by this worker")
    if attempt.epoch != request.epoch or attempt.worker_id != request.worker.worker_id:
        raise LeaseLost("epoch does not match the current lease")
    if attempt.state == AttemptState.RUNNING:
        return _start_receipt(attempt)
    if attempt.state == AttemptState.CANCELLED:
        raise TaskCancelled("task was cancelled before start")
    if attempt.state != AttemptState.LEASED or attempt.lease_expires_at <= now:
        raise LeaseLost("lease is no longer valid")
    if deadline_failure(task, now) is not None:
        raise DeadlinePassed()
    if queue.paused or queue.retired_at is not None:
        raise QueuePaused("queue is paused")
    _approve_start(task, attempt, state, queue, now, *key)
    started.append((task, attempt))
    return _start_receipt(attempt)


def _approve_start(
    task: Task,
    attempt: Attempt,
    state: QueueState,
    queue: Queue,
    now: datetime,
    key_row: ConcurrencyKey | None = None,
    rule: KeyRule | None = None,
) -> None:
    """Counts a Start in its queue's rate window (a new window when the last
    one is over) and, under a key's rate, in its key's GCRA state, and moves
    the task and attempt to RUNNING, in memory, under the locks of all of
    them; RateLimited, with nothing changed, when the window is full or the
    key has no start room. The queue state (and key row) is shared by a
    group's Starts: each approval counts in what the next one sees."""
    refusal = _start_refusal(state, queue, now, key_row, rule)
    if refusal is not None:
        raise refusal
    _count_start(task, attempt, state, now, key_row, rule)


def _count_start(
    task: Task, attempt: Attempt, state: QueueState, now: datetime, key_row: ConcurrencyKey | None, rule: KeyRule | None
) -> None:
    """_approve_start's changes, for a Start nothing refuses (_start_refusal)."""
    if not window_open(state, now):
        state.window_started_at = now
        state.window_count = 0
    state.window_count += 1
    if key_row is not None:
        _count_key_start(key_row, attempt, rule, now)
    task.attempts += 1
    task.state = TaskState.RUNNING
    task.updated_at = now
    attempt.state = AttemptState.RUNNING
    attempt.number = task.attempts
    attempt.started_at = now
    attempt.lease_expires_at = max(attempt.lease_expires_at, lease_expiry(task, now))


def _start_refusal(
    state: QueueState, queue: Queue, now: datetime, key_row: ConcurrencyKey | None, rule: KeyRule | None
) -> RateLimited | None:
    """What refuses a Start now, changing nothing: its key's rate, or its
    queue's full start window (a window that is over starts anew, empty, and
    rate_per_second is at least 1)."""
    rate = rule.rate if rule is not None else None
    if key_row is not None and rate is not None and not rate.start_allowed(key_row.rate_tat, now):
        return RateLimited(rate.retry_after_ms(key_row.rate_tat, now), KEY_RATE_REACHED)
    if window_open(state, now) and state.window_count >= queue.rate_per_second:
        remaining = cast(datetime, state.window_started_at) + RATE_WINDOW - now
        return RateLimited(max(1, math.ceil(remaining.total_seconds() * 1000)))
    return None


def _count_key_start(key_row: ConcurrencyKey, attempt: Attempt, rule: KeyRule | None, now: datetime) -> None:
    """A keyed Start's share of its key row, in memory: its rate's next
    arrival time, and the room its lease reserved given back."""
    if attempt.key_rate_reserved and attempt.state == AttemptState.LEASED:
        key_row.rate_reserved = max(0, key_row.rate_reserved - 1)
    if rule is not None and rule.rate is not None:
        key_row.rate_tat = rule.rate.after_start(key_row.rate_tat, now)
    if rule is not None:
        cache_rule(key_row, rule, now)


@outermost
def renew_lease(*, worker: WorkerContext, attempt_id: str, epoch: int) -> dict[str, Any]:
    """Extends an active lease (and with it the key permit the attempt holds).

    Locks the worker's credential and the attempt row; never past the task's total deadline."""
    refuse_revoked([worker])  # credentials come before attempts in the global order
    attempt = lock_attempt(attempt_id)
    now = timezone.now()  # after the lock: the lease is judged as of now
    if attempt is None or not worker.owns_attempt(attempt):
        raise LeaseLost("attempt is not held by this worker")  # as for one that does not exist
    if attempt.epoch != epoch or attempt.state not in ACTIVE_ATTEMPT_STATES or attempt.lease_expires_at <= now:
        raise LeaseLost("lease is no longer valid")
    task = Task.objects.only("lease_seconds", "deadline_at", "cancel_requested").get(id=attempt.task_id)
    expires = lease_expiry(task, now)
    if expires > attempt.lease_expires_at:
        attempt.lease_expires_at = expires
        attempt.save(update_fields=["lease_expires_at"])
    return {"lease_expires_at": format_time(attempt.lease_expires_at), "cancel_requested": task.cancel_requested}


def held_entry(task: Task, attempt: Attempt) -> dict[str, Any]:
    entry = assignment(task, attempt)
    entry["state"] = attempt.state
    if attempt.number is not None:
        entry["attempt_number"] = attempt.number
    return entry


def resume_attempt(*, worker: WorkerContext, attempt_id: str, epoch: int) -> dict[str, Any]:
    """The same assignment again, for a worker that reconnected within its lease."""
    refuse_revoked([worker], locked=False)  # it grants nothing, but answers the payload
    attempt = _peek_own_attempt(worker, attempt_id)
    if (
        attempt.epoch != epoch
        or attempt.state not in ACTIVE_ATTEMPT_STATES
        or attempt.lease_expires_at <= timezone.now()
    ):
        raise LeaseLost("lease is no longer valid")
    task = Task.objects.get(id=attempt.task_id)
    entry = held_entry(task, attempt)
    attach_dependencies([(task, entry)])
    return entry


def held_assignments(*, worker: WorkerContext) -> list[dict[str, Any]]:
    """The attempts this connection may resume (hello's `held`): those of its
    worker identity in queues its credential may consume. Others of the same
    worker_id run out their lease as if their worker were gone."""
    attempts = list(
        Attempt.objects.filter(
            **worker.range_filter(),
            state__in=list(ACTIVE_ATTEMPT_STATES),
            lease_expires_at__gt=timezone.now(),
        ).order_by("leased_at")
    )
    tasks = Task.objects.in_bulk([a.task_id for a in attempts])
    entries = [(tasks[a.task_id], held_entry(tasks[a.task_id], a)) for a in attempts if a.task_id in tasks]
    attach_dependencies(entries)
    return [entry for _, entry in entries]


def held_attempt_ids(*, worker: WorkerContext) -> set[str]:
    """Ids of the attempts this connection holds right now (capacity accounting)."""
    return {attempt.attempt_id for attempt in held_attempts(worker=worker)}


@dataclass(frozen=True)
class HeldAttempt:
    attempt_id: str
    epoch: int
    state: str
    session_id: str
    started_ahead: bool  # RUNNING by its lease's round (a result's start_next), not by a task.start


def held_attempts(*, worker: WorkerContext) -> list[HeldAttempt]:
    """The attempts this connection holds right now, and which session leased each."""
    rows = Attempt.objects.filter(
        **worker.range_filter(),
        state__in=list(ACTIVE_ATTEMPT_STATES),
        lease_expires_at__gt=timezone.now(),
    ).values_list("id", "epoch", "state", "session_id", "started_at", "leased_at")
    return [
        HeldAttempt(attempt_id, epoch, state, session_id, started_with_its_lease(started_at, leased_at))
        for attempt_id, epoch, state, session_id, started_at, leased_at in rows
    ]

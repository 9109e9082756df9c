"""Key budgets (SPEC §12: a key policy's capacity and start rate, fair shares
between fairness keys; README "keys") as a seeded, reproducible, model-based
random walk.

Each seed makes one or two queues (mostly roomy, sometimes tight), a few
concurrency keys under exact and prefix key policies made, reconfigured and
retired over the API while tasks hold and wait for their permits (capacity
lowered below the current holders, a rate set, raised, lowered or removed
mid-window, a policy retired so its keys fall back to a prefix or the
default), and then takes random steps through the single-item doors every
caller uses: submits (some with a fairness_key), leases by 2–3 workers,
Starts, results (SUCCEEDED, FAILED retryable or not, UNKNOWN), results that
hand their slot on with the next task started ahead (one round: the
worker protocol's start_next), releases, cancels, reviews, and time moved on (this process's clock, frozen and
advanced by the test) so that leases expire, recovery runs, backoffs elapse
and rates refill.

A pure-Python model of the rules predicts every Start's answer (the key's
GCRA: T = per_seconds / starts, tolerance (burst − 1)·T; a lease reserves a
Start's room per attempt it leases under a rate) and every key's holders,
slots, token and rate state; after each step the database is held against
it, and:

- a lease never grants a key's permit while its holders are at its capacity
  (as the policies resolve it now: a lowered capacity keeps its holders and
  grants nothing until fewer hold), nor one its rate has no Start's room for;
- tokens strictly rise per key, each grant on the lowest free slot;
- a Start, and a hand-off's Start ahead, is approved exactly when the key's
  GCRA state and its queue's window allow it (RATE_LIMITED with the key's
  retry_after_ms otherwise);
- a key's waiting task gets a permit once its key has room and its rate
  allows: a lease that came back short while the model still sees a task that
  fits is followed by up to two more leases at the same instant, and they must
  take something (SPEC §12: "a limited key never blocks the queue's other keys
  or unkeyed tasks");
- the approved Starts of each key, as the database recorded them, replayed
  through GCRA from the key's last rule change, never exceed burst + t / T;
- the key rows' cached capacity and next_start_at never hide a key with room;
- within equal priority a lease of the fair queue serves the group served
  least recently first (SPEC §12 "Fair shares");
- assert_invariants().

A failing seed is reproduced alone with `-k "seed-17"`;
ORBIT_RANDOM_KEY_BUDGET_SEEDS=N runs N seeds (a longer hunt),
ORBIT_RANDOM_KEY_BUDGET_FIRST the first one, ORBIT_RANDOM_KEY_BUDGET_STEPS
the steps per seed, ORBIT_RANDOM_KEY_BUDGET_LOG=1 the whole step log on a
failure. The last test runs several workers on shared keys with capacity
above 1 and a rate at once, each thread on its own connection, and checks
the same bounds from the rows afterwards."""

from __future__ import annotations

import math
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest

from tasks.actions import endings
from tasks.actions.endings import ResultReport
from tasks.actions.keys import describe_key
from tasks.actions.rounds import LeaseRequest, run_round
from tasks.key_rules import Rate
from tasks.models import Attempt, ConcurrencyKey, Task
from tests.conftest import api_client, post_json
from tests.support import random_walk as walk
from tests.support.api import make_queue
from tests.support.gcra import gcra_violations
from tests.support.key_policies import POLICIES, create_body
from tests.support.random_walk import clock_fixture  # noqa: F401 - fixture "clock"
from tests.support.tasks import assert_invariants, cancel, resolve, run_threads, task_body, worker_for

FIRST_SEED = int(os.environ.get("ORBIT_RANDOM_KEY_BUDGET_FIRST", "0"))
SEEDS = int(os.environ.get("ORBIT_RANDOM_KEY_BUDGET_SEEDS", "4"))
STEPS = int(os.environ.get("ORBIT_RANDOM_KEY_BUDGET_STEPS", "90"))
STATS: Counter[str] = Counter()

KEYS = ["b/a", "b/b", "c/x"]
MATCHES = [("key", "b/a"), ("key", "b/b"), ("key", "c/x"), ("prefix", "b/"), ("prefix", "c/")]
GROUPS = ["t/1", "t/2", "t/3", ""]  # fairness keys of the fair queue ("": none)
NEVER = (-1, -1)  # a fairness group never served ranks before every served one


# --- the model -----------------------------------------------------------------

RateSpec = tuple[int, int, int]  # starts, per_seconds, burst


def interval(rate: RateSpec) -> timedelta:
    # T = per_seconds / starts, to the microsecond the database keeps, never faster
    return timedelta(microseconds=math.ceil(rate[1] * 1_000_000 / rate[0]))


def tolerance(rate: RateSpec) -> timedelta:
    return interval(rate) * (rate[2] - 1)


def next_lease_at(tat: datetime | None, reserved: int, now: datetime, rate: RateSpec) -> datetime:
    """When one more Start of the key would conform if its `reserved` leased,
    unstarted attempts all started now (GCRA replayed forward)."""
    base = max(tat, now) if tat is not None else now
    return base + interval(rate) * reserved - tolerance(rate)


@dataclass
class MPolicy:
    id: str
    kind: str
    value: str
    capacity: int
    rate: RateSpec | None
    revision: int = 1


@dataclass(frozen=True)
class MRule:
    capacity: int = 1
    rate: RateSpec | None = None
    policy: str | None = None


@dataclass
class MKey:
    version: int = 0  # the row's version: its last token
    tat: datetime | None = None  # GCRA theoretical arrival time
    epoch: int = 0  # +1 whenever the key's resolved rule changes
    changed_at: datetime | None = None
    held_before_change: set[str] = field(default_factory=set)  # holders kept through a lowered capacity


@dataclass
class Model(walk.WalkModel):
    policies: dict[tuple[str, str], MPolicy] = field(default_factory=dict)  # live ones by match
    keys: dict[str, MKey] = field(default_factory=lambda: {key: MKey() for key in KEYS})
    served: dict[str, tuple[int, int]] = field(default_factory=dict)  # fair group → (lease, place)

    def rule(self, key: str) -> MRule:
        """An exact policy wins, then the longest matching prefix, else capacity 1 and no rate."""
        exact = self.policies.get(("key", key))
        if exact is not None:
            return MRule(exact.capacity, exact.rate, exact.id)
        prefixes = [p for (kind, value), p in self.policies.items() if kind == "prefix" and key.startswith(value)]
        if prefixes:
            best = max(prefixes, key=lambda p: len(p.value))
            return MRule(best.capacity, best.rate, best.id)
        return MRule()

    def reserved(self, key: str) -> int:
        return sum(1 for a in self.holders(key) if a.state == "LEASED" and a.reserved)

    def key_room(self, key: str, now: datetime) -> int:
        """Permits a lease may still grant the key now: its capacity's and its rate's."""
        rule, state = self.rule(key), self.keys[key]
        room = rule.capacity - len(self.holders(key))
        if rule.rate is not None:
            rate, reserved = rule.rate, self.reserved(key)
            fits = 0
            while fits < room and next_lease_at(state.tat, reserved + fits, now, rate) <= now:
                fits += 1
            room = fits
        return max(room, 0)

    def headroom(self, q: int, now: datetime) -> int:
        queue = self.queues[q]
        active = [a for a in self.active() if a.task.queue == q]
        reserved = sum(1 for a in active if a.state == "LEASED")
        return min(queue.max_concurrency - len(active), queue.rate - self.window_used(queue, now) - reserved)

    def leasable(self, task: walk.ModelTask, worker: walk.ModelWorker, now: datetime) -> bool:
        return task.state == "WAITING" and task.queue in worker.queues and task.available_at <= now

    def fits(self, worker: walk.ModelWorker, now: datetime) -> list[walk.ModelTask]:
        """Waiting tasks a lease of this worker could take now: their queue and key have room."""
        return [
            t
            for t in self.tasks.values()
            if self.leasable(t, worker, now)
            and self.headroom(t.queue, now) > 0
            and (not t.key or self.key_room(t.key, now) > 0)
        ]

    def key_released(self, key: str) -> None:
        self.keys[key].version += 1


def rate_body(rate: RateSpec | None) -> dict[str, Any]:
    return {} if rate is None else {"rate": {"starts": rate[0], "per_seconds": rate[1], "burst": rate[2]}}


# --- one seed's run -----------------------------------------------------------------


class Run(walk.RandomWalk):
    model: Model

    def __init__(self, tenant: Any, clock: walk.Clock, seed: int) -> None:
        super().__init__(tenant, clock, seed)
        rng = self.rng
        self.leases = 0
        queues = []
        for n in range(rng.randint(1, 2)):
            tight = rng.random() < 0.25
            limits = {
                "max_concurrency": rng.randint(2, 4) if tight else 50,
                "rate_per_second": rng.choice([2, 3]) if tight else 1000,
            }
            made = make_queue(tenant.client, f"q{n}", **limits)
            queues.append(
                walk.ModelQueue(
                    made["id"], made["max_concurrency"], made["rate_per_second"], made["max_unfinished_tasks"]
                )
            )
        self.model = Model(queues)
        for kind, value in MATCHES:
            if rng.random() < 0.45:
                self.create_policy((kind, value))
        self.workers = []
        for n in range(rng.randint(2, 3)):
            # worker 0 serves the fair queue alone, so its leases show the fair order
            chosen = (0,) if n == 0 else tuple(sorted(rng.sample(range(len(queues)), rng.randint(1, len(queues)))))
            context = worker_for(tenant, *(queues[q].id for q in chosen), worker_id=f"w{n}")
            self.workers.append(walk.ModelWorker(n, context, chosen))
        self.fair = False  # whether queue 0 ranks its fairness keys round robin yet

    # --- helpers ---

    def context(self) -> str:
        shown = self.log if os.environ.get("ORBIT_RANDOM_KEY_BUDGET_LOG") else self.log[-25:]
        policies = {f"{k}:{v}": (p.capacity, p.rate) for (k, v), p in self.model.policies.items()}
        return f"seed {self.seed} step {self.steps} policies {policies}:\n" + "\n".join(shown)

    def random_rule(self) -> tuple[int, RateSpec | None]:
        rng = self.rng
        capacity = rng.choice([1, 2, 2, 3, 4])
        rate = None
        if rng.random() < 0.6:
            rate = (rng.randint(1, 3), rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 2, 3]))
        return capacity, rate

    # --- policies ---

    def rules_changed(self, before: dict[str, MRule]) -> None:
        """What a policy change does to every key: a key whose rule changed
        starts a new rate epoch (its Starts are replayed from here), its
        current holders are kept, and its arrival time is brought back to
        burst·T ahead under its new rate (tasks.key_rules.cache_rule, run by
        the change's reconcile)."""
        for key in KEYS:
            rule, state = self.model.rule(key), self.model.keys[key]
            if rule.rate is not None and state.tat is not None:
                latest = self.now + interval(rule.rate) * rule.rate[2]
                state.tat = min(state.tat, latest)
            if rule != before[key]:
                state.epoch += 1
                state.changed_at = self.now
                state.held_before_change |= {a.id for a in self.model.holders(key)}
                if len(self.model.holders(key)) > rule.capacity:
                    STATS["capacity lowered below holders"] += 1

    def create_policy(self, match: tuple[str, str] | None = None) -> bool:
        match = match or self.pick(MATCHES)
        capacity, rate = self.random_rule()
        body = create_body({match[0]: match[1]}, capacity=capacity, **rate_body(rate))
        response = post_json(self.tenant.client, POLICIES, body, key=f"policy-{self.steps}-{self.rng.random()}")
        data = response.json()
        self.note(f"create policy {match} cap {capacity} rate {rate} -> {response.status_code}")
        STATS[f"policy create {response.status_code}"] += 1
        if match in self.model.policies:
            assert response.status_code == 409 and data["error"]["code"] == "STATE_CONFLICT", (data, self.context())
            return True
        assert response.status_code == 201, (data, self.context())
        policy = data["data"]["policy"]
        assert policy["capacity"] == capacity and policy.get("rate") == rate_body(rate).get("rate"), policy
        before = {key: self.model.rule(key) for key in KEYS}
        self.model.policies[match] = MPolicy(policy["id"], match[0], match[1], capacity, rate)
        self.rules_changed(before)
        return True

    def configure_policy(self) -> bool:
        live = sorted(self.model.policies.values(), key=lambda p: p.id)
        holding = [p for p in live if any(self.model.rule(k).policy == p.id and self.model.holders(k) for k in KEYS)]
        policy = self.pick(holding) if holding and self.rng.random() < 0.7 else self.pick(live)
        if policy is None:
            return False
        capacity, rate = self.random_rule()
        held = [len(self.model.holders(k)) for k in KEYS if self.model.rule(k).policy == policy.id]
        if held and max(held) > 1 and self.rng.random() < 0.7:  # below the holders one of its keys has now
            capacity = self.rng.randint(1, max(held) - 1)
        stale = self.rng.random() < 0.1
        revision = policy.revision + 1 if stale else policy.revision
        body = {"expected_revision": str(revision), "reason": "budget", "capacity": capacity, **rate_body(rate)}
        response = post_json(
            self.tenant.client, f"{POLICIES}/{policy.id}:configure", body, key=f"configure-{self.steps}-{stale}"
        )
        data = response.json()
        self.note(
            f"configure policy {policy.kind}:{policy.value} cap {capacity} rate {rate}"
            f"{' (stale)' if stale else ''} -> {response.status_code}"
        )
        STATS[f"policy configure {response.status_code}"] += 1
        if stale:
            assert response.status_code == 409 and data["error"]["code"] == "STATE_CONFLICT", (data, self.context())
            return True
        assert response.status_code == 200, (data, self.context())
        assert data["data"]["policy"]["revision"] == str(policy.revision + 1), (data, self.context())
        before = {key: self.model.rule(key) for key in KEYS}
        policy.capacity, policy.rate, policy.revision = capacity, rate, policy.revision + 1
        self.rules_changed(before)
        return True

    def retire_policy(self) -> bool:
        policy = self.pick(sorted(self.model.policies.values(), key=lambda p: p.id))
        if policy is None:
            return False
        body = {"expected_revision": str(policy.revision), "reason": "done"}
        response = post_json(self.tenant.client, f"{POLICIES}/{policy.id}:retire", body, key=f"retire-{self.steps}")
        self.note(f"retire policy {policy.kind}:{policy.value} -> {response.status_code}")
        STATS[f"policy retire {response.status_code}"] += 1
        assert response.status_code == 200, (response.content, self.context())
        before = {key: self.model.rule(key) for key in KEYS}
        del self.model.policies[(policy.kind, policy.value)]
        self.rules_changed(before)
        return True

    def policy(self) -> bool:
        roll = self.rng.random()
        if roll < 0.4:
            return self.create_policy()
        if roll < 0.85:
            return self.configure_policy()
        return self.retire_policy()

    # --- submits ---

    def submit(self) -> bool:
        rng = self.rng
        queue = rng.randrange(len(self.model.queues))
        self.submits += 1
        extra: dict[str, Any] = {"payload": {"n": self.submits}, "priority": rng.choice([3, 5, 5, 5, 7])}
        if rng.random() < 0.8:
            extra["concurrency_key"] = rng.choice(KEYS)
        group = ""
        if queue == 0 and rng.random() < 0.7:
            group = rng.choice(GROUPS)
            if group:
                extra["fairness_key"] = group
                self.fair = True
        extra["max_attempts"] = rng.randint(1, 4)
        extra["retry"] = {"initial_seconds": rng.choice([0, 1]), "multiplier": 1, "max_seconds": 1}
        extra["lease_seconds"] = rng.choice([5, 10, 30])
        body = task_body(self.model.queues[queue].id, **extra)
        response = post_json(self.tenant.client, "/v1/tasks", body, key=f"s{self.submits}")
        assert response.status_code == 201, (response.content, self.context())
        task = response.json()["data"]["task"]
        self.model.tasks[task["id"]] = walk.ModelTask(
            id=task["id"],
            index=len(self.model.tasks),
            queue=queue,
            key=extra.get("concurrency_key", ""),
            group=group,
            priority=extra["priority"],
            max_attempts=extra["max_attempts"],
            lease_seconds=extra["lease_seconds"],
            retry=(extra["retry"]["initial_seconds"], 1, 1),
            available_at=self.now,
        )
        self.note(f"submit t{len(self.model.tasks) - 1} q{queue} key {extra.get('concurrency_key')} group {group!r}")
        STATS["submits"] += 1
        return True

    # --- leases ---

    def lease(
        self, worker: walk.ModelWorker | None = None, limit: int | None = None, follow_up: int = 0, hand_off: Any = None
    ) -> bool:
        if worker is None:
            self.clock.advance(0.001)  # leases apart in time, so fair groups' served times are too
            worker = self.pick(self.workers)
        limit = limit or self.rng.randint(1, 4)
        model, now = self.model, self.now
        ns = self.tenant.namespace_id
        ready = set(Task.objects.filter(namespace_id=ns, state="WAITING", key_ready=True).values_list("id", flat=True))
        rooms = {q: model.headroom(q, now) for q in worker.queues}
        key_rooms = {k: model.key_room(k, now) for k in KEYS}
        fits_before = model.fits(worker, now)
        for key in KEYS:
            if any(model.leasable(t, worker, now) and t.key == key for t in model.tasks.values()):
                full = len(model.holders(key)) >= model.rule(key).capacity
                STATS["lease met a key at capacity" if full else "lease met a rate-limited key"] += not key_rooms[key]
        served_before = dict(model.served)
        if hand_off is None:
            code, answer = self.lease_tasks(worker, limit)
        else:
            # the result first, in the same round: what it frees is the lease's to take
            ended, outcome, retryable, call, answers = hand_off
            code, answer = walk.code_of(call)
            self.reported(ended, outcome, retryable, "ok", answers[0])
            rooms = {q: model.headroom(q, now) for q in worker.queues}
            key_rooms = {k: model.key_room(k, now) for k in KEYS}
            ready = None  # what the result made ready is not known before the round
        assert code == "ok", (answer, self.context())
        got = [model.tasks[entry["task"]["id"]] for entry in answer]
        kind = " (follow-up)" if follow_up else " (hand-off)" if hand_off else ""
        self.note(
            f"lease w{worker.index} limit {limit}{kind} -> "
            f"{[(t.index, t.key, t.group) for t in got]} (fits {[t.index for t in fits_before]}, "
            f"key rooms {key_rooms})"
        )
        STATS["leases"] += 1
        STATS["tasks leased"] += len(got)
        self.leases += 1
        assert len(got) <= limit, self.context()
        for task in got:
            assert model.leasable(task, worker, now), (f"t{task.index} was not leasable", self.context())
        for q, count in Counter(t.queue for t in got).items():
            assert count <= rooms[q], (f"q{q} took {count} with room {rooms[q]}", self.context())
        # each grant within the key's capacity and rate, in the order granted
        for entry, task in zip(answer, got, strict=True):
            task.epoch += 1
            assert entry["epoch"] == task.epoch, (entry, self.context())
            token = slot = None
            reserved = False
            if task.key:
                rule, state = model.rule(task.key), model.keys[task.key]
                holders = model.holders(task.key)
                assert len(holders) < rule.capacity, (
                    f"t{task.index}: {task.key} granted with {len(holders)} holders at capacity {rule.capacity}",
                    self.context(),
                )
                if rule.rate is not None:
                    reserved = True
                    at = next_lease_at(state.tat, model.reserved(task.key), now, rule.rate)
                    assert at <= now, (
                        f"t{task.index}: {task.key} leased with no Start's room until {at}",
                        self.context(),
                    )
                state.version += 1
                token = state.version
                assert int(entry["concurrency_token"]) == token, (entry, token, self.context())
                if rule.capacity > 1:
                    slot = walk.lowest_free_slot(holders, rule.capacity)
                    assert entry.get("concurrency_slot") == slot, (entry, slot, self.context())
                else:
                    assert "concurrency_slot" not in entry, (entry, self.context())
                STATS[f"granted at capacity {rule.capacity}{' rated' if rule.rate else ''}"] += 1
            else:
                assert "concurrency_token" not in entry and "concurrency_slot" not in entry, entry
            expires = now + timedelta(seconds=task.lease_seconds)
            assert walk.parse(entry["lease_expires_at"]) == expires, (entry, self.context())
            attempt = walk.ModelAttempt(
                entry["attempt_id"], task, worker.index, task.epoch, expires, token, slot, reserved=reserved
            )
            model.leased(task, attempt)
            if hand_off is not None:
                # started ahead exactly when a Start of it would be approved now
                allowed = self.start_refusal(task) is None
                assert (entry.get("state") == "RUNNING") == allowed, (entry, allowed, self.context())
                if allowed:
                    attempt.reserved = False
                    self.approve(attempt)
                    assert entry["attempt_number"] == task.attempts, (entry, self.context())
                    STATS["started ahead"] += 1
                    STATS[f"started ahead under a rate {task.key}"] += bool(task.key and model.rule(task.key).rate)
            else:
                assert "state" not in entry, (entry, self.context())
        if ready is not None:
            self.check_fair_order(worker, got, ready, key_rooms, served_before, now)
        # served times are kept once the queue is fair: from the first task
        # with a fairness_key it accepted (docs/decisions.md "Off until used")
        fair = [t for t in got if t.queue == 0] if self.fair else []
        for place, task in enumerate(fair):
            model.served[task.group] = (self.leases, place)
        # a key with room and rate is never passed over: what still fits goes in a next lease at once
        want = min(limit, 16)
        if len(got) < want:
            left = model.fits(worker, now)
            if left and follow_up >= 2:
                pytest.fail(
                    f"three leases left tasks that fit: {[(t.index, t.key, t.queue, t.id in ready) for t in left]}, "
                    f"key rooms { ({k: model.key_room(k, now) for k in KEYS}) }\n{self.context()}"
                )
            if left:
                STATS["follow-up leases"] += 1
                self.lease(worker, want - len(got), follow_up + 1)
        return True

    def check_fair_order(
        self,
        worker: walk.ModelWorker,
        got: list[walk.ModelTask],
        ready: set[str],
        key_rooms: dict[str, int],
        served: dict[str, tuple[int, int]],
        now: datetime,
    ) -> None:
        """SPEC §12: within equal priority a lease serves fairness keys round
        robin, the key served least recently first, then oldest available_at.
        Held for worker 0, which serves the fair queue alone: a task it left
        that ranks before one it took, although the model gives its key room
        and no task of the lease took that key."""
        if worker.index != 0 or not got:
            return
        taken = {t.id for t in got}
        keys_taken = {t.key for t in got if t.key}
        # what waited before the lease: those still WAITING, and those it took
        waiting = [
            t
            for t in self.model.tasks.values()
            if t.queue == 0 and t.available_at <= now and (t.state == "WAITING" or t.id in taken)
        ]
        eligible = [
            t
            for t in waiting
            if t.id not in taken and (not t.key or (t.id in ready and key_rooms[t.key] > 0 and t.key not in keys_taken))
        ]

        def place_in_group(task: walk.ModelTask) -> int:
            """The task's place among its group's waiting ready tasks at its
            priority (an upper bound on the lease's ranking: rn)."""
            peers = [
                t
                for t in waiting
                if t.group == task.group and t.priority == task.priority and (not t.key or t.id in ready)
            ]
            return 1 + sum(1 for t in peers if (t.available_at, t.id) < (task.available_at, task.id))

        for n, h in enumerate(got):
            rn_h = 1 + sum(1 for t in got[:n] if t.group == h.group and t.priority == h.priority)
            rank_h = (-h.priority, rn_h, served.get(h.group, NEVER), h.available_at, h.id)
            for g in eligible:
                rank_g = (-g.priority, place_in_group(g), served.get(g.group, NEVER), g.available_at, g.id)
                assert rank_g > rank_h, (
                    f"the fair lease took t{h.index} ({h.group!r}, p{h.priority}, rank {rank_h}) and left "
                    f"t{g.index} ({g.group!r}, p{g.priority}, key {g.key!r}, rank {rank_g})",
                    self.context(),
                )
        STATS["fair leases checked"] += 1

    # --- a worker's verbs on its attempts ---

    def start(self) -> bool:
        attempt = self.attempt_to_start()
        if attempt is None:
            return False
        task, now = attempt.task, self.now
        code, answer = self.approve_start(attempt)
        retry_after = None
        if attempt.state == "RUNNING":
            expected = "ok"
        elif attempt.lease_expires_at <= now:
            expected = "LEASE_LOST"
        elif (refusal := self.start_refusal(task)) is not None:
            expected, retry_after = "RATE_LIMITED", refusal or None
        else:
            expected = "ok"
            self.approve(attempt)
        self.note(f"start t{task.index} {task.key} ({attempt.state}) -> {code} (model {expected} {retry_after})")
        STATS[f"start {code}{' key' if retry_after else ''}"] += 1
        assert code == expected, (code, answer, expected, self.context())
        if retry_after is not None:
            assert answer.retry_after_ms == retry_after, (answer.retry_after_ms, retry_after, self.context())
        return True

    def start_refusal(self, task: walk.ModelTask) -> int | None:
        """None when a Start of the task is approved now; else the key's
        retry_after_ms (its rate), or 0 (its queue's start window is full)."""
        model, now = self.model, self.now
        rule = model.rule(task.key) if task.key else MRule()
        if rule.rate is not None:
            tat = model.keys[task.key].tat
            if tat is not None and tat - tolerance(rule.rate) > now:
                return max(1, math.ceil((tat - tolerance(rule.rate) - now).total_seconds() * 1000))
        queue = model.queues[task.queue]
        return 0 if model.window_used(queue, now) >= queue.rate else None

    def approve(self, attempt: walk.ModelAttempt) -> None:
        """An approved Start: the queue's window, the key's GCRA state, the task RUNNING."""
        model, now, task = self.model, self.now, attempt.task
        model.count_start(model.queues[task.queue], now)
        if task.key:
            rule, state = model.rule(task.key), model.keys[task.key]
            if rule.rate is not None:
                state.tat = max(state.tat, now) + interval(rule.rate) if state.tat else now + interval(rule.rate)
            attempt.start_epoch = state.epoch
        task.attempts += 1
        task.state = attempt.state = "RUNNING"
        attempt.lease_expires_at = max(attempt.lease_expires_at, now + timedelta(seconds=task.lease_seconds))

    def report(self) -> bool:
        running = [a for a in self.model.active() if a.state == "RUNNING"]
        attempt = self.pick(running)
        if attempt is None:
            return False
        outcome = self.rng.choices(["SUCCEEDED", "FAILED", "UNKNOWN"], [60, 30, 10])[0]
        retryable = outcome == "FAILED" and self.rng.random() < 0.7
        code, answer = self.record_result(attempt, outcome, retryable=retryable, output=None)
        self.reported(attempt, outcome, retryable, code, answer)
        return True

    def hand_off(self) -> bool:
        """A result whose frame also asks for the worker's next task, started
        ahead (README "Worker protocol", start_next): one round records the
        result, then leases into the slot it frees, starting what it takes
        when a Start would be approved now, under the key's rate too."""
        running = [a for a in self.model.active() if a.state == "RUNNING" and a.lease_expires_at > self.now]
        attempt = self.pick(running)
        if attempt is None:
            return False
        worker = self.workers[attempt.worker]
        outcome = self.rng.choices(["SUCCEEDED", "FAILED"], [80, 20])[0]
        retryable = outcome == "FAILED"
        result = ResultReport(
            worker.context, attempt.id, attempt.epoch, outcome, retryable, None, walk.error_of(outcome)
        )
        limit = self.rng.randint(1, 2)
        lease = LeaseRequest(worker.context, limit, after=result, start_ahead=("echo", "v1"))
        answers: list[Any] = []

        def call() -> list[dict[str, Any]]:
            answers.extend(run_round([result, lease]))
            assert not isinstance(answers[0], BaseException), (answers, self.context())
            return answers[1].assignments

        self.clock.advance(0.001)
        self.lease(worker, limit, hand_off=(attempt, outcome, retryable, call, answers))
        return True

    def reported(self, attempt: walk.ModelAttempt, outcome: str, retryable: bool, code: str, answer: Any) -> None:
        task, now = attempt.task, self.now
        self.note(f"result t{task.index} {outcome}{' retryable' if retryable else ''} -> {code}")
        STATS[f"result {code}"] += 1
        if attempt.lease_expires_at <= now:
            self.model.recover(attempt, now)
            attempt.late = True
            expected = walk.result_answer(task, duplicate=False, late=True)
        else:
            self.model.finish(attempt, outcome, retryable, now)
            expected = walk.result_answer(task, duplicate=False, late=False)
        assert code == "ok" and answer == expected, (code, answer, expected, self.context())

    def release(self) -> bool:
        attempt = self.pick([a for a in self.model.active() if a.state == "LEASED"])
        if attempt is None:
            return False
        code, answer = self.release_attempt(attempt)
        self.note(f"release t{attempt.task.index} -> {code}")
        STATS[f"release {code}"] += 1
        assert code == "ok", (code, answer, self.context())
        self.model.end_attempt(attempt, "RELEASED")
        attempt.task.state = "WAITING"
        return True

    # --- the client's verbs ---

    def cancel(self) -> bool:
        unfinished = [t for t in self.model.tasks.values() if t.state in ("WAITING", "LEASED", "RUNNING")]
        task = self.pick(sorted(unfinished, key=lambda t: t.index))
        if task is None:
            return False
        if task.attempt is not None and task.attempt.lease_expires_at <= self.now:
            return False  # the recovery's to take first
        response = cancel(self.tenant.client, task.id, f"cancel-{self.steps}")
        self.note(f"cancel t{task.index} ({task.state}) -> {response.status_code}")
        STATS[f"cancel {task.state} {response.status_code}"] += 1
        assert response.status_code == 200, (response.content, self.context())
        if task.state == "RUNNING":
            task.cancel_requested = True
        else:
            if task.attempt is not None:
                self.model.end_attempt(task.attempt, "CANCELLED")
            task.state = "CANCELLED"
            task.cancel_requested = True
        return True

    def resolve(self) -> bool:
        review = [t for t in self.model.tasks.values() if t.state == "NEEDS_REVIEW"]
        task = self.pick(sorted(review, key=lambda t: t.index))
        if task is None:
            return False
        resolution = "SUCCEEDED" if task.cancel_requested else self.rng.choice(["SUCCEEDED", "RETRY", "RETRY"])
        response = resolve(self.tenant.client, task.id, f"resolve-{self.steps}", resolution)
        self.note(f"resolve t{task.index} {resolution} -> {response.status_code}")
        assert response.status_code == 200, (response.content, self.context())
        self.model.resolved(task, resolution, self.now)
        return True

    def advance(self) -> bool:
        self.pass_time([(0.05, 0.5), (0.5, 3), (5, 35)], [55, 35, 10])
        STATS["time moved"] += 1
        if self.rng.random() < 0.8:
            expired = [a for a in self.model.active() if a.lease_expires_at <= self.now]
            for attempt in expired:
                self.model.recover(attempt, self.now)
            assert endings.recover_expired_leases() == len(expired), self.context()
            self.note(f"recover -> {len(expired)}")
        return True

    # --- the step and the checks ---

    def actions(self) -> list[tuple[Callable[[], bool], float]]:
        # the order counts as much as the weights: rng.choices draws by position
        worker = [(self.lease, 8), (self.start, 7), (self.report, 4), (self.hand_off, 3), (self.release, 0.7)]
        client = [(self.cancel, 0.7), (self.resolve, 1), (self.policy, 2)]
        return [(self.submit, 5), *worker, *client, (self.advance, 3)]

    def check(self) -> None:
        model, ns, context, now = self.model, self.tenant.namespace_id, self.context, self.now
        rows = {
            row["id"]: row
            for row in Task.objects.filter(namespace_id=ns).values("id", "state", "attempts", "epoch", "available_at")
        }
        assert set(rows) == set(model.tasks), context()
        for task_id, task in model.tasks.items():
            row = rows[task_id]
            seen = (row["state"], row["attempts"], row["epoch"], row["available_at"])
            wanted = (task.state, task.attempts, task.epoch, task.available_at)
            assert seen == wanted, (f"t{task.index}", seen, wanted, context())
        attempts = {
            row["id"]: row
            for row in Attempt.objects.filter(namespace_id=ns).values(
                "id", "state", "concurrency_token", "concurrency_slot", "concurrency_key", "started_at"
            )
        }
        assert set(attempts) == set(model.attempts), context()
        for attempt_id, attempt in model.attempts.items():
            row = attempts[attempt_id]
            assert row["state"] == attempt.state, (f"t{attempt.task.index}", row, attempt.state, context())
            assert row["concurrency_token"] == attempt.token, (row, context())
            if attempt.state in walk.ACTIVE and attempt.slot is not None:
                assert row["concurrency_slot"] == attempt.slot, (row, context())
        key_rows = {row.key: row for row in ConcurrencyKey.objects.filter(namespace_id=ns)}
        for key in KEYS:
            rule, state, holders = model.rule(key), model.keys[key], model.holders(key)
            # never more holders than its capacity, but for those a lowered capacity kept
            kept = [a for a in holders if a.id in state.held_before_change]
            assert len(holders) <= max(rule.capacity, len(kept)), (key, len(holders), rule, context())
            assert len(holders) - len(kept) <= rule.capacity, (key, context())
            row = key_rows.get(key)
            if row is None:
                assert state.version == 0 and not holders, (key, context())
                continue
            seen = (row.version, row.holders, row.rate_tat, row.rate_reserved)
            wanted = (state.version, len(holders), state.tat, model.reserved(key))
            assert seen == wanted, (key, "version holders tat reserved", seen, wanted, context())
            # the scan's cached filter never hides a key that has room (a row
            # made by another path than a lease, a cancel's, caches capacity 1
            # until its first lease: that only costs the lease a look)
            if row.holders >= row.capacity:
                assert len(holders) >= rule.capacity, (key, row.capacity, rule, context())
            if rule.rate is None:
                assert row.next_start_at is None or row.next_start_at <= now, (key, row.next_start_at, context())
            elif row.next_start_at is not None:
                truth = next_lease_at(state.tat, model.reserved(key), now, rule.rate)
                assert row.next_start_at <= max(truth, now), (key, row.next_start_at, truth, context())
            # the key as the API shows it
            shown = describe_key(ns, key)
            assert shown["capacity"] == rule.capacity and shown.get("policy_id") == rule.policy, (shown, context())
            assert shown["highest_token"] == str(state.version), (shown, context())
            by_slot = sorted(((a.slot or 0), str(a.token)) for a in holders)
            assert sorted((h["slot"], h["token"]) for h in shown["holders"]) == by_slot, (shown, context())
            if rule.rate is not None:
                truth = max(now, next_lease_at(state.tat, model.reserved(key), now, rule.rate))
                shown_at = walk.parse(shown["next_start_at"])
                assert abs(shown_at - truth) < timedelta(milliseconds=1), (shown, truth, context())
                assert shown["reserved_starts"] == model.reserved(key), (shown, context())
            # the Starts since its rule last changed, as the rows recorded them, within the GCRA bound
            if rule.rate is not None:
                started = [
                    attempts[a.id]["started_at"]
                    for a in model.attempts.values()
                    if a.task.key == key and a.start_epoch == state.epoch
                ]
                late = gcra_violations(started, Rate(*rule.rate))
                assert late == [], (key, rule.rate, sorted(started), late, context())
        # tokens rise per key, in the order granted
        for key in KEYS:
            tokens = [a.token for a in model.attempts.values() if a.task.key == key]
            assert tokens == sorted(set(tokens)), (key, tokens, context())
        assert_invariants()


@pytest.mark.django_db
@pytest.mark.parametrize("seed", [f"seed-{n}" for n in range(FIRST_SEED, FIRST_SEED + SEEDS)])
def test_random_key_budgets_follow_the_rules(tenant: Any, clock: walk.Clock, seed: str) -> None:
    Run.walked(tenant, clock, seed, STEPS)
    STATS["seeds"] += 1
    if os.environ.get("ORBIT_RANDOM_KEY_BUDGET_STATS"):
        print(seed, dict(sorted(STATS.items())))


# --- real concurrency ------------------------------------------------------------------

CONCURRENT_TASKS = 60
CONCURRENT_WORKERS = 4
CONCURRENT_POLICIES: dict[str, tuple[int, RateSpec | None]] = {
    "s/a": (2, (20, 1, 2)),
    "s/b": (3, (30, 1, 3)),
    "s/c": (2, None),
}
# a tenth released unstarted, a twentieth abandoned once started, the rest reported after a
# short while; a RATE_LIMITED Start waits its retry_after_ms and is tried again
LEASE_HABITS = walk.LeaseHabits(
    most=3,
    release_below=0.1,
    abandon_below=0.15,
    outcomes=("SUCCEEDED", "FAILED"),
    weights=(80, 20),
    start_tries=40,
    think_seconds=0.01,
)


@pytest.mark.django_db(transaction=True)
def test_workers_on_shared_budgeted_keys_at_once_keep_capacity_rate_and_tokens(tenant: Any) -> None:
    # given keys of capacity 2–3, two with a start rate, and keyed and unkeyed tasks in two queues
    rng = random.Random(11)
    for key, (capacity, rate) in CONCURRENT_POLICIES.items():
        body = create_body({"key": key}, capacity=capacity, **rate_body(rate))
        assert post_json(tenant.client, POLICIES, body, key=f"policy-{key}").status_code == 201
    queues = [make_queue(tenant.client, f"c{n}", max_concurrency=6, rate_per_second=1000)["id"] for n in range(2)]
    ids = walk.submit_concurrent_tasks(tenant, queues, CONCURRENT_TASKS, sorted(CONCURRENT_POLICIES), 0.85, rng)
    stop = threading.Event()

    def work(index: int) -> Counter[str]:
        if index < CONCURRENT_WORKERS:
            return walk.work_leases(tenant, queues, index, stop, LEASE_HABITS)
        # recovery and review, round and round
        done: Counter[str] = Counter()
        client = api_client(tenant.token)
        while not stop.is_set():
            done["recovered"] += endings.recover_expired_leases()
            walk.resolve_reviews(client, ids, done, lambda: "RETRY")
            if walk.unfinished(ids) == 0:
                stop.set()
            time.sleep(0.005)
        return done

    results = run_threads(CONCURRENT_WORKERS + 1, work, timeout=90)
    stop.set()
    totals = sum(results, Counter())
    # then every task finished (no key starved), the invariants hold, and per key:
    # never more permits at once than its capacity, tokens rising in lease order
    # (per slot too), and its Starts within the GCRA bound
    assert walk.unfinished(ids) == 0, totals
    assert_invariants()
    attempts = list(Attempt.objects.filter(task_id__in=ids))
    for key, (capacity, rate) in CONCURRENT_POLICIES.items():
        held = walk.assert_key_held_within(attempts, key, capacity)
        for slot in {a.concurrency_slot for a in held}:
            assert slot is not None and 0 <= slot < capacity, (key, slot)
        if rate is not None:
            started = [a.started_at for a in held if a.started_at is not None]
            assert gcra_violations(started, Rate(*rate)) == [], (key, sorted(started))
    assert totals["leased"] >= CONCURRENT_TASKS, totals
    if os.environ.get("ORBIT_RANDOM_KEY_BUDGET_STATS"):
        print(dict(sorted(totals.items())))

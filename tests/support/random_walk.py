"""What the seeded, model-based random walks share (tests/tasks/test_random_lifecycle.py,
tests/key_budgets/test_random_key_budgets.py): the frozen clock, the model's rows and
the rules both hold the same way, a walk's single-item doors and step loop, and the
pieces of their threaded tests (the workers' lease loop, the reviews, the per-key checks).

Each walk keeps its own knobs, STATS and checks; what differs between them (the lease
order, key policies, deadlines) stays in its file, on subclasses of RandomWalk and WalkModel."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Self

import pytest
from django.utils import timezone

from orbit.errors import OrbitError
from tasks.actions import dispatch, endings, rounds
from tasks.actions.context import WorkerContext
from tasks.models import Attempt, Task
from tests.support.tasks import resolve, submit_ok, worker_for

FINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
ACTIVE = frozenset({"LEASED", "RUNNING"})
START_WINDOW = timedelta(seconds=1)  # a queue's rate_per_second counts the Starts of one such window


class Clock:
    """timezone.now for the whole test: frozen, moved on by the test only."""

    def __init__(self) -> None:
        real = datetime.now(UTC)
        # whole milliseconds, as the API's RFC 3339 times carry them, so answers compare equal
        self.now = real.replace(microsecond=real.microsecond // 1000 * 1000)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(milliseconds=round(seconds * 1000))


@pytest.fixture(name="clock")
def clock_fixture(monkeypatch: pytest.MonkeyPatch) -> Clock:
    frozen = Clock()
    monkeypatch.setattr(timezone, "now", frozen)
    return frozen


def code_of(call: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", answer) or (error code, the error)."""
    try:
        return "ok", call()
    except OrbitError as error:
        return error.code, error


def parse(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def error_of(outcome: str) -> dict[str, Any] | None:
    """The error a result of this outcome reports."""
    return None if outcome == "SUCCEEDED" else {"code": "boom"}


# --- the model's rows --------------------------------------------------------------
# One shape for both walks: a field only one walk uses keeps its default in the other.


@dataclass
class ModelQueue:
    id: str
    max_concurrency: int
    rate: int
    max_unfinished: int
    paused: bool = False
    window_started_at: datetime | None = None
    window_count: int = 0


@dataclass
class ModelAttempt:
    id: str
    task: ModelTask
    worker: int
    epoch: int
    lease_expires_at: datetime
    token: int | None
    slot: int | None
    state: str = "LEASED"
    number: int | None = None
    outcome: bool = False  # ended by a reported result
    late: bool = False  # late evidence stored
    reserved: bool = False  # leased under a key's rate: holds a Start's room of its key
    start_epoch: int | None = None  # its key's rule epoch at its Start


@dataclass
class ModelTask:
    id: str
    index: int
    queue: int
    key: str
    priority: int
    max_attempts: int
    retry: tuple[float, float, float]
    lease_seconds: int
    available_at: datetime
    group: str = ""  # its fairness_key
    deadline_at: datetime | None = None
    start_deadline_at: datetime | None = None
    state: str = "WAITING"
    attempts: int = 0
    epoch: int = 0
    cancel_requested: bool = False
    attempt: ModelAttempt | None = None  # the active one


@dataclass
class ModelWorker:
    index: int
    context: WorkerContext
    queues: tuple[int, ...]
    keys: bool = True  # whether it takes keyed tasks


@dataclass
class WalkModel:
    """The rules both walks state alike; each walk's Model adds its own, and says
    how a key's version moves when a holder lets go (key_released)."""

    queues: list[ModelQueue]
    tasks: dict[str, ModelTask] = field(default_factory=dict)
    attempts: dict[str, ModelAttempt] = field(default_factory=dict)

    def active(self) -> list[ModelAttempt]:
        return [t.attempt for t in self.tasks.values() if t.attempt is not None]

    def holders(self, key: str) -> list[ModelAttempt]:
        return [a for a in self.active() if a.task.key == key]

    def window_used(self, queue: ModelQueue, now: datetime) -> int:
        open_ = queue.window_started_at is not None and now < queue.window_started_at + START_WINDOW
        return queue.window_count if open_ else 0

    def count_start(self, queue: ModelQueue, now: datetime) -> None:
        """An approved Start takes one of its queue's window, opening a new window if none is open."""
        if self.window_used(queue, now) == 0:
            queue.window_started_at, queue.window_count = now, 0
        queue.window_count += 1

    @staticmethod
    def deadline_failure(task: ModelTask, now: datetime) -> str | None:
        if task.deadline_at is not None and task.deadline_at <= now:
            return "DEADLINE_EXCEEDED"
        if task.start_deadline_at is not None and task.start_deadline_at <= now and task.attempts == 0:
            return "START_DEADLINE_EXCEEDED"
        return None

    def backoff(self, task: ModelTask) -> timedelta:
        initial, multiplier, most = task.retry
        return timedelta(seconds=min(initial * multiplier ** max(task.attempts - 1, 0), most))

    def leased(self, task: ModelTask, attempt: ModelAttempt) -> None:
        self.attempts[attempt.id] = attempt
        task.attempt = attempt
        task.state = "LEASED"

    def key_released(self, key: str) -> None:
        raise NotImplementedError

    def end_attempt(self, attempt: ModelAttempt, state: str, *, outcome: bool = False) -> None:
        task = attempt.task
        assert task.attempt is attempt
        attempt.state = state
        attempt.outcome = outcome
        task.attempt = None
        if task.key:
            self.key_released(task.key)  # releasing advances the key's version

    def recover(self, attempt: ModelAttempt, now: datetime) -> None:
        task = attempt.task
        if attempt.state == "LEASED":
            self.end_attempt(attempt, "EXPIRED")
            task.state = "FAILED" if self.deadline_failure(task, now) else "WAITING"
        else:
            self.end_attempt(attempt, "UNKNOWN")
            task.state = "NEEDS_REVIEW"

    def resolved(self, task: ModelTask, resolution: str, now: datetime) -> None:
        """An accepted review: RETRY makes the task available again at once."""
        if resolution == "RETRY":
            task.state = "WAITING"
            task.available_at = now
        else:
            task.state = resolution

    def finish(self, attempt: ModelAttempt, outcome: str, retryable: bool, now: datetime) -> None:
        """A RUNNING attempt's result, reported in time."""
        task = attempt.task
        if outcome == "SUCCEEDED":
            self.end_attempt(attempt, "SUCCEEDED", outcome=True)
            task.state = "SUCCEEDED"
        elif outcome == "UNKNOWN":
            self.end_attempt(attempt, "UNKNOWN", outcome=True)
            task.state = "NEEDS_REVIEW"
        else:
            self.end_attempt(attempt, "FAILED", outcome=True)
            if task.cancel_requested:
                task.state = "CANCELLED"
            elif retryable and task.attempts < task.max_attempts:
                task.state = "WAITING"
                task.available_at = now + self.backoff(task)
            else:
                task.state = "FAILED"


def result_answer(task: ModelTask, *, duplicate: bool, late: bool) -> dict[str, Any]:
    """What record_result answers once the model has applied the result."""
    return {"task_state": task.state, "duplicate": duplicate, "late": late}


def lowest_free_slot(holders: list[ModelAttempt], capacity: int) -> int:
    """The slot a key of capacity > 1 grants next (a holder granted without one, at capacity 1, holds slot 0)."""
    held = {a.slot or 0 for a in holders}
    return min(s for s in range(capacity) if s not in held)


# --- one seed's walk ---------------------------------------------------------------


class RandomWalk:
    """A seed's run: its rng, step log and workers, and the doors it calls. A
    subclass makes the model and workers, names its weighted actions and checks."""

    model: WalkModel
    workers: list[ModelWorker]

    def __init__(self, tenant: Any, clock: Clock, seed: int) -> None:
        self.tenant, self.clock, self.seed = tenant, clock, seed
        self.rng = random.Random(seed)
        self.log: list[str] = []
        self.steps = 0
        self.submits = 0

    @property
    def now(self) -> datetime:
        return self.clock.now

    def note(self, text: str) -> None:
        self.log.append(f"[{self.steps}] {text}")

    def context(self) -> str:
        raise NotImplementedError

    def pick(self, items: list[Any]) -> Any:
        return self.rng.choice(items) if items else None

    def worker_of(self, attempt: ModelAttempt) -> WorkerContext:
        return self.workers[attempt.worker].context

    def attempt_to_start(self) -> ModelAttempt | None:
        """A leased attempt, or any active one when none is leased (a Start of a running one is answered too)."""
        leased = [a for a in self.model.active() if a.state == "LEASED"]
        return self.pick(leased) or self.pick(self.model.active())

    # --- the step ---

    def actions(self) -> list[tuple[Callable[[], bool], float]]:
        """The weighted steps; each returns False when it found nothing to do."""
        raise NotImplementedError

    def check(self) -> None:
        raise NotImplementedError

    def step(self) -> None:
        self.steps += 1
        actions = self.actions()
        # a step that found nothing to do draws again, so most steps do something
        for _ in range(20):
            action = self.rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
            if action():
                break
        self.check()

    @classmethod
    def walked(cls, tenant: Any, clock: Clock, seed: str, steps: int) -> Self:
        """The run of the seed named "seed-N" (the test's id, so that `-k "seed-17"` picks it), after its steps."""
        run = cls(tenant, clock, int(seed.split("-")[1]))
        run.check()
        for _ in range(steps):
            run.step()
        return run

    def pass_time(self, spans: list[tuple[float, float]], weights: list[int]) -> None:
        """Moves the clock on by a while drawn from one of the spans, chosen by weight."""
        seconds = self.rng.choices([self.rng.uniform(low, high) for low, high in spans], weights)[0]
        self.clock.advance(seconds)
        self.note(f"time +{seconds:.3f}s")

    # --- the single-item doors: (code, answer) as code_of gives them ---

    def lease_tasks(self, worker: ModelWorker, limit: int) -> tuple[str, Any]:
        return code_of(lambda: rounds.lease_tasks(worker=worker.context, limit=limit))

    def approve_start(self, attempt: ModelAttempt) -> tuple[str, Any]:
        return code_of(
            lambda: rounds.approve_start(worker=self.worker_of(attempt), attempt_id=attempt.id, epoch=attempt.epoch)
        )

    def renew_lease(self, attempt: ModelAttempt) -> tuple[str, Any]:
        return code_of(
            lambda: dispatch.renew_lease(worker=self.worker_of(attempt), attempt_id=attempt.id, epoch=attempt.epoch)
        )

    def record_result(
        self, attempt: ModelAttempt, outcome: str, *, retryable: bool, output: dict[str, Any] | None
    ) -> tuple[str, Any]:
        return code_of(
            lambda: rounds.record_result(
                worker=self.worker_of(attempt),
                attempt_id=attempt.id,
                epoch=attempt.epoch,
                outcome=outcome,
                retryable=retryable,
                output=output,
                error=error_of(outcome),
            )
        )

    def release_attempt(self, attempt: ModelAttempt) -> tuple[str, Any]:
        return code_of(
            lambda: endings.release_attempt(
                worker=self.worker_of(attempt), attempt_id=attempt.id, epoch=attempt.epoch, reason="not now"
            )
        )


# --- the threaded tests ------------------------------------------------------------


def submit_concurrent_tasks(
    tenant: Any, queues: list[str], count: int, keys: list[str], keyed_share: float, rng: random.Random
) -> list[str]:
    """`count` tasks over the queues in turn, some keyed, retried at once: their ids."""
    ids = []
    for n in range(count):
        extra: dict[str, Any] = {"priority": rng.randint(0, 9), "max_attempts": 3, "payload": {"n": n}}
        extra["retry"] = {"initial_seconds": 0, "multiplier": 1, "max_seconds": 0}
        if rng.random() < keyed_share:
            extra["concurrency_key"] = rng.choice(keys)
        ids.append(submit_ok(tenant.client, queues[n % 2], f"c{n}", **extra)["id"])
    return ids


def unfinished(ids: list[str]) -> int:
    return Task.objects.filter(id__in=ids).exclude(state__in=list(FINAL)).count()


def resolve_reviews(client: Any, ids: list[str], done: Counter[str], resolution: Callable[[], str]) -> None:
    """Resolves every task of `ids` in NEEDS_REVIEW, as the reviewing thread does round after round."""
    for task_id in Task.objects.filter(id__in=ids, state="NEEDS_REVIEW").values_list("id", flat=True):
        response = resolve(client, task_id, f"r-{task_id}-{done['resolved']}", resolution())
        done["resolved"] += response.status_code == 200


@dataclass(frozen=True)
class LeaseHabits:
    """How a threaded worker treats what it leases, by one roll per lease."""

    most: int  # tasks asked for per lease: 1 to most
    release_below: float  # roll below: released unstarted
    abandon_below: float  # roll below (once started): the worker dies and recovery takes the lease
    outcomes: tuple[str, ...]
    weights: tuple[int, ...]
    start_tries: int = 1  # a RATE_LIMITED Start is tried again within the lease, up to this many times
    think_seconds: float = 0  # at most this long between a Start and its result


def work_leases(
    tenant: Any,
    queues: list[str],
    index: int,
    stop: threading.Event,
    habits: LeaseHabits,
    after_round: Callable[[WorkerContext, random.Random, list[dict[str, Any]], Counter[str]], None] | None = None,
) -> Counter[str]:
    """A worker thread: leases, Starts and reports until `stop` (or a minute), and
    after each lease calls after_round with the leases it ended so far."""
    done: Counter[str] = Counter()
    wrng = random.Random(index)
    worker = worker_for(tenant, *queues, worker_id=f"cw{index}")
    ended: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    while not stop.is_set() and time.monotonic() < deadline:
        for lease in rounds.lease_tasks(worker=worker, limit=wrng.randint(1, habits.most)):
            done["leased"] += 1
            if work_lease(worker, wrng, lease, habits, done):
                ended.append(lease)
        if after_round is not None:
            after_round(worker, wrng, ended, done)
        time.sleep(wrng.uniform(0, 0.003))
    return done


def work_lease(
    worker: WorkerContext, wrng: random.Random, lease: dict[str, Any], habits: LeaseHabits, done: Counter[str]
) -> bool:
    """One leased task, released, abandoned or reported: whether its attempt ended."""
    roll = wrng.random()
    if roll < habits.release_below:
        endings.release_attempt(worker=worker, attempt_id=lease["attempt_id"], epoch=lease["epoch"], reason="x")
        done["released"] += 1
        return True
    for tries_left in range(habits.start_tries - 1, -1, -1):
        code, answer = code_of(
            lambda: rounds.approve_start(worker=worker, attempt_id=lease["attempt_id"], epoch=lease["epoch"])
        )
        if code != "RATE_LIMITED" or not tries_left:
            break
        done["start RATE_LIMITED"] += 1
        time.sleep(min(answer.retry_after_ms, 100) / 1000)
    if code != "ok":
        done[f"start {code}"] += 1
        return False
    if roll < habits.abandon_below:
        # the worker dies: its lease runs out (moved to the past) and recovery takes it
        Attempt.objects.filter(id=lease["attempt_id"]).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
        done["abandoned"] += 1
        return True
    if habits.think_seconds:
        time.sleep(wrng.uniform(0, habits.think_seconds))
    outcome = wrng.choices(habits.outcomes, habits.weights)[0]
    code, _ = report_lease(worker, lease, outcome, retryable=True)
    done[f"result {code}"] += 1
    return True


def report_lease(worker: WorkerContext, lease: dict[str, Any], outcome: str, *, retryable: bool) -> tuple[str, Any]:
    """The result of a leased attempt, as a threaded worker reports it: (code, answer)."""
    return code_of(
        lambda: rounds.record_result(
            worker=worker,
            attempt_id=lease["attempt_id"],
            epoch=lease["epoch"],
            outcome=outcome,
            retryable=retryable,
            output=None,
            error=error_of(outcome),
        )
    )


def assert_key_held_within(attempts: list[Attempt], key: str, capacity: int) -> list[Attempt]:
    """A key's attempts, from the rows: tokens rising in lease order, never more
    permits at once than its capacity. Returns the key's attempts."""
    held = [a for a in attempts if a.concurrency_key == key]
    ordered = sorted(held, key=lambda a: (a.leased_at, a.concurrency_token))
    tokens = [a.concurrency_token for a in ordered]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), (key, tokens)
    moments = sorted([(a.leased_at, 1) for a in held] + [(a.finished_at, -1) for a in held if a.finished_at])
    running = 0
    for _, change in moments:
        running += change
        assert running <= capacity, (key, running, capacity)
    return held

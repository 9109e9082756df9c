"""Dependencies (SPEC §13) on random graphs: seeded, reproducible DAGs (chains,
diamonds, shared grandparents, wide joins, now and then a fan-out wider than
INLINE_EDGES) submitted one by one and through POST /v1/tasks:batch with
`ref:NAME`, ended in random order with random outcomes (success, failure,
UNKNOWN then review, a client's cancel, a deadline), the follow-ups run now
and then. After every step the database is held against a small pure-Python
model of the rules and against the invariants: every task's state path is
legal and ends at most once, nothing runs before all its parents ended (nor
after a failed one under CANCEL), `blocked_by` counts the unsettled edges,
and nothing is left BLOCKED once its parents ended. A last test ends shared
parents from several threads at once, with their own connections.

A failing seed is reproduced alone with `-k "seed-17"`; ORBIT_RANDOM_GRAPH_SEEDS=N
runs N seeds instead of the default (a longer hunt)."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from orbit.models import Event
from tasks.actions import rounds
from tasks.actions.dependencies import INLINE_EDGES, run_follow_ups
from tasks.actions.endings import fail_for_deadline
from tasks.actions.permits import settle
from tasks.models import DependencySettlement, Task, TaskDependency
from tests.conftest import api_client, post_json
from tests.support.api import make_queue
from tests.support.dependencies import moves_of
from tests.support.tasks import (
    an_hour_on,
    assert_invariants,
    cancel,
    in_seconds,
    lease_one,
    report,
    resolve,
    run_threads,
    start,
    submit_ok,
    task_body,
    wait_until,
    worker_for,
)

FIRST_SEED = int(os.environ.get("ORBIT_RANDOM_GRAPH_FIRST", "0"))
SEEDS = int(os.environ.get("ORBIT_RANDOM_GRAPH_SEEDS", "12"))
# Longer hunts: the share of graphs with a wide fan-out, and edges more than INLINE_EDGES + 120
# it may have (past INLINE_EDGES + FOLLOW_UP_CHUNK, its follow-up takes several chunks).
FAN_SHARE = float(os.environ.get("ORBIT_RANDOM_GRAPH_FAN_SHARE", "0.15"))
FAN_EXTRA = int(os.environ.get("ORBIT_RANDOM_GRAPH_FAN_EXTRA", "0"))
# What the seeds did, summed over the session (ORBIT_RANDOM_GRAPH_STATS=1 prints it per seed).
STATS: Counter[str] = Counter()
FINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
FAILED_STATES = frozenset({"FAILED", "CANCELLED"})
# (previous, state) of every move a task may make in these tests; None: its submit.
LEGAL_MOVES = {
    (None, "BLOCKED"),
    (None, "WAITING"),
    (None, "CANCELLED"),
    ("BLOCKED", "WAITING"),
    ("BLOCKED", "CANCELLED"),
    ("BLOCKED", "FAILED"),
    ("WAITING", "LEASED"),
    ("WAITING", "CANCELLED"),
    ("WAITING", "FAILED"),
    ("LEASED", "RUNNING"),
    ("LEASED", "CANCELLED"),
    ("LEASED", "FAILED"),
    ("RUNNING", "SUCCEEDED"),
    ("RUNNING", "FAILED"),
    ("RUNNING", "CANCELLED"),
    ("RUNNING", "NEEDS_REVIEW"),
    ("NEEDS_REVIEW", "SUCCEEDED"),
    ("NEEDS_REVIEW", "FAILED"),
    ("NEEDS_REVIEW", "WAITING"),
}


# --- the model -----------------------------------------------------------


@dataclass
class Node:
    index: int
    parents: list[int]
    policy: str  # CANCEL | RUN
    queue: int
    priority: int
    key: str | None = None
    deadline: bool = False
    fan: bool = False  # a member of a wide fan-out
    id: str = ""


@dataclass
class Model:
    """The rules (SPEC §13) on the graph: a BLOCKED task is CANCELLED once a
    parent is FAILED or CANCELLED under CANCEL, WAITING once every parent
    ended (under RUN whatever their ends), BLOCKED otherwise. The tasks the
    test moves itself take the state the database gave them; the rest follow
    from the rules, in index order (parents come first)."""

    nodes: list[Node]
    state: dict[int, str] = field(default_factory=dict)  # submitted tasks only
    by_dependency: set[int] = field(default_factory=set)  # cancelled by the rules

    def admitted(self, index: int) -> str:
        return self._rule(index, "BLOCKED") if self.nodes[index].parents else "WAITING"

    def _rule(self, index: int, current: str) -> str:
        node = self.nodes[index]
        if current != "BLOCKED" or not node.parents:
            return current
        states = [self.state[p] for p in node.parents]
        if node.policy == "CANCEL" and any(s in FAILED_STATES for s in states):
            self.by_dependency.add(index)
            return "CANCELLED"
        if all(s in FINAL for s in states):
            return "WAITING"
        return "BLOCKED"

    def settle(self) -> None:
        for index in sorted(self.state):
            self.state[index] = self._rule(index, self.state[index])

    def moved(self, index: int, state: str) -> None:
        """The test moved this task itself (a verb's answer)."""
        self.state[index] = state
        self.by_dependency.discard(index)
        self.settle()


# --- the graphs -------------------------------------------------------------


def random_graph(rng: random.Random, queues: int) -> list[Node]:
    """5–40 tasks, parents among the earlier ones; shapes mixed per seed."""
    size = rng.randint(5, 40)
    shape = rng.choice(["random", "chain", "diamonds", "layers", "joins", "grandparents"])
    nodes: list[Node] = []
    for index in range(size):
        parents: list[int] = []
        if index and rng.random() > 0.2:
            if shape == "chain":
                parents = [index - 1] + ([index - 2] if index > 1 and rng.random() < 0.3 else [])
            elif shape == "diamonds":
                # each task on the one before and on that one's parent: diamonds in a row
                parents = sorted({index - 1, *nodes[index - 1].parents[:1]})
            elif shape == "layers":
                width = 4
                layer = index // width
                below = list(range(max(0, (layer - 1) * width), layer * width))
                parents = rng.sample(below, rng.randint(1, len(below))) if below else []
            elif shape == "joins":
                parents = (
                    rng.sample(range(index), rng.randint(1, index)) if rng.random() < 0.4 else [rng.randrange(index)]
                )
            elif shape == "grandparents":
                roots = list(range(min(index, 3)))
                parents = sorted(set(rng.sample(roots, rng.randint(1, len(roots))) + [rng.randrange(index)]))
            else:
                count = rng.choice([1, 1, 1, 2, 2, 3, 5, index])
                parents = rng.sample(range(index), min(count, index))
        nodes.append(
            Node(
                index=index,
                parents=sorted(set(parents)),
                policy="RUN" if rng.random() < 0.3 else "CANCEL",
                queue=rng.randrange(queues),
                priority=rng.randint(0, 9),
                key=rng.choice(["k/a", "k/b"]) if rng.random() < 0.25 else None,
                deadline=rng.random() < 0.15,
            )
        )
    if rng.random() < FAN_SHARE:
        # a fan-out wider than the inline budget: its members (leaves, some
        # with a second parent) go right after the root, later tasks may
        # depend on them
        root = rng.randrange(max(1, size // 2))
        other = rng.randrange(size)
        width = INLINE_EDGES + rng.randint(1, 120) + FAN_EXTRA
        fan = [
            Node(
                index=0,
                parents=sorted({root, other}) if n % 7 == 3 and other < root + 1 else [root],
                policy="RUN" if rng.random() < 0.3 else "CANCEL",
                queue=queues,  # a queue of their own: leased only when the test means to
                priority=rng.randint(0, 9),
                fan=True,
            )
            for n in range(width)
        ]
        at = root + 1
        shift = {old: (old if old < at else old + width) for old in range(size)}
        for node in nodes:
            node.parents = [shift[p] for p in node.parents]
        for node in fan:
            node.parents = [shift[p] for p in node.parents]
        nodes[at:at] = fan
        for index, node in enumerate(nodes):
            node.index = index
            if not node.fan and node.parents and rng.random() < 0.2:
                # now and then a later task depends on a fan member too
                candidates = [m.index for m in nodes[:index] if m.fan]
                if candidates:
                    node.parents = sorted(set(node.parents) | {rng.choice(candidates)})
    for node in nodes:
        assert all(p < node.index for p in node.parents)
    return nodes


# --- one seed's run ------------------------------------------------------------


class Run:
    def __init__(self, tenant: Any, seed: int, nodes: list[Node] | None = None, queues: int = 0) -> None:
        self.tenant = tenant
        self.rng = random.Random(seed)
        if nodes is None:
            queues = self.rng.randint(1, 3)
            nodes = random_graph(self.rng, queues)
        self.nodes = nodes
        self.fans = any(node.fan for node in self.nodes)
        self.queues = [
            make_queue(tenant.client, f"q{n}", max_concurrency=1000, rate_per_second=100_000)["id"]
            for n in range(queues + self.fans)
        ]
        self.model = Model(self.nodes)
        self.index_of: dict[str, int] = {}
        self.submitted = 0  # the next node to submit
        self.upto = len(self.nodes)  # submit_some submits nodes below it
        self.held: dict[int, dict] = {}  # leases held, by node
        self.started: set[int] = set()
        self.last_seq = 0
        self.paths: dict[int, list[tuple[str | None, str, int]]] = {}  # (previous, state, seq)
        self.final_seq: dict[int, int] = {}
        self.steps = 0
        self.log: list[str] = []
        self.rows: dict[int, tuple] = {}
        self.pending: set[str] = set()

    # --- submits ---

    def overrides(self, node: Node, depends_on: list[str]) -> dict[str, Any]:
        extra: dict[str, Any] = {"max_attempts": 1, "priority": node.priority, "payload": {"n": node.index}}
        if depends_on:
            extra["depends_on"] = depends_on
            if node.policy == "RUN" or self.rng.random() < 0.5:
                extra["on_dependency_failure"] = node.policy
        if node.key:
            extra["concurrency_key"] = node.key
        if node.deadline:
            extra["deadline_at"] = in_seconds(1800)
        return extra

    def submit_some(self) -> bool:
        """The next node alone, or the next few (a fan-out whole) in one batch with refs."""
        first = self.submitted
        node = self.nodes[first]
        if node.fan or (not self.rng.random() < 0.5 and first + 1 < self.upto):
            last = first + 1
            if node.fan:
                while last < len(self.nodes) and self.nodes[last].fan and last - first < 500:
                    last += 1
            else:
                last = min(self.upto, first + self.rng.randint(2, 8))
                while last > first + 1 and self.nodes[last - 1].fan:
                    last -= 1
            items = []
            for member in self.nodes[first:last]:
                depends_on = [f"ref:t{p}" if p >= first else self.nodes[p].id for p in member.parents]
                items.append(
                    {
                        "idempotency_key": f"t{member.index}",
                        "ref": f"t{member.index}",
                        "task": task_body(self.queues[member.queue], **self.overrides(member, depends_on)),
                    }
                )
            self.log.append(f"batch t{first}..t{last - 1}")
            response = post_json(self.tenant.client, "/v1/tasks:batch", {"tasks": items})
            assert response.status_code == 200, response.content
            results = response.json()["data"]["results"]
            assert [r["status"] for r in results] == [201] * len(items), results
            for member, result in zip(self.nodes[first:last], results, strict=True):
                self.admit(member, result["task"])
        else:
            depends_on = [self.nodes[p].id for p in node.parents]
            self.log.append(f"submit t{first}")
            self.admit(
                node,
                submit_ok(self.tenant.client, self.queues[node.queue], f"t{first}", **self.overrides(node, depends_on)),
            )
        return True

    def admit(self, node: Node, task: dict[str, Any]) -> None:
        node.id = task["id"]
        self.index_of[node.id] = node.index
        self.submitted = node.index + 1
        expected = self.model.admitted(node.index)
        self.model.state[node.index] = expected
        if node.parents:
            assert task["depends_on"] == [self.nodes[p].id for p in node.parents]
        if not self.pending:
            assert task["state"] == expected, (node.index, task["state"], expected)

    # --- the moves ---

    def db_state(self, index: int) -> str:
        return self.rows[index][0]

    def agreed(self, *states: str, fan: bool = False) -> list[int]:
        """Nodes in one of these states, where the model and the database agree."""
        return [
            i
            for i, s in self.model.state.items()
            if s in states and self.db_state(i) == s and (fan or not self.nodes[i].fan)
        ]

    def lease(self) -> bool:
        waiting = self.agreed("WAITING", fan=self.rng.random() < 0.15)
        if not waiting:
            return False
        queue = self.nodes[self.rng.choice(waiting)].queue
        worker = worker_for(self.tenant, self.queues[queue], worker_id=f"w{self.steps}")
        assigned = rounds.lease_tasks(worker=worker, limit=self.rng.randint(1, 4))
        for assignment in assigned:
            index = self.index_of[assignment["task"]["id"]]
            node = self.nodes[index]
            # leased only once every parent ended, never after a failed one under CANCEL
            assert self.model.state[index] == "WAITING", (index, self.model.state[index])
            parents = [self.model.state[p] for p in node.parents]
            assert all(s in FINAL for s in parents), (index, parents)
            assert node.policy == "RUN" or not any(s in FAILED_STATES for s in parents), (index, parents)
            shown = [(d["task_id"], d["state"]) for d in assignment.get("dependencies", [])]
            assert shown == [(self.nodes[p].id, self.model.state[p]) for p in node.parents], (index, shown)
            self.held[index] = {"worker": worker, **assignment}
            self.started.discard(index)
            self.model.moved(index, "LEASED")
            if self.rng.random() < 0.5:
                start(self.held[index])
                self.started.add(index)
                self.model.moved(index, "RUNNING")
        self.log.append(f"lease q{queue} -> {[self.index_of[a['task']['id']] for a in assigned]}")
        return bool(assigned)

    def end(self) -> bool:
        ready = [i for i in self.held if self.db_state(i) in ("LEASED", "RUNNING")]
        if not ready:
            return False
        index = self.rng.choice(sorted(ready))
        lease = self.held.pop(index)
        if index not in self.started:
            start(lease)
            self.started.add(index)
        outcome = self.rng.choices(["SUCCEEDED", "FAILED", "UNKNOWN"], [55, 30, 15])[0]
        error = None if outcome == "SUCCEEDED" else {"code": "boom"}
        answer = report(lease, outcome, output={"n": index}, error=error)
        expected = {"SUCCEEDED": "SUCCEEDED", "FAILED": "FAILED", "UNKNOWN": "NEEDS_REVIEW"}[outcome]
        cancel_requested = self.rows[index][4]
        assert answer["task_state"] == expected or (cancel_requested and answer["task_state"] in FINAL), (
            index,
            outcome,
            answer,
        )
        self.log.append(f"t{index} {outcome} -> {answer['task_state']}")
        self.model.moved(index, answer["task_state"])
        return True

    def review(self, drain: bool) -> bool:
        reviewed = self.agreed("NEEDS_REVIEW", fan=True)
        if not reviewed:
            return False
        index = self.rng.choice(sorted(reviewed))
        choices = ["SUCCEEDED", "FAILED"] if drain or self.rows[index][4] else ["SUCCEEDED", "FAILED", "RETRY"]
        resolution = self.rng.choice(choices)
        response = resolve(self.tenant.client, self.nodes[index].id, f"resolve-{self.steps}", resolution)
        assert response.status_code == 200, response.content
        state = "WAITING" if resolution == "RETRY" else resolution
        assert response.json()["data"]["task"]["state"] == state
        self.log.append(f"t{index} resolved {resolution}")
        self.model.moved(index, state)
        return True

    def cancel_one(self, fan: bool = False) -> bool:
        states = (
            ("BLOCKED", "WAITING", "LEASED")
            if self.rng.random() < 0.85
            else ("BLOCKED", "WAITING", "LEASED", "RUNNING")
        )
        cancellable = self.agreed(*states, fan=fan)
        if fan:
            # fan members, those a task outside the fan-out waits for first
            cancellable = [i for i in cancellable if self.nodes[i].fan]
            awaited = {p for n in self.nodes if not n.fan and n.index in self.rows for p in n.parents}
            cancellable = [i for i in cancellable if i in awaited] or cancellable
        if not cancellable:
            return False
        index = self.rng.choice(sorted(cancellable))
        before = self.db_state(index)
        response = cancel(self.tenant.client, self.nodes[index].id, f"cancel-{self.steps}")
        assert response.status_code == 200, response.content
        state = response.json()["data"]["task"]["state"]
        self.log.append(f"cancel t{index} ({before}) -> {state}")
        if before == "RUNNING":
            assert state == "RUNNING"
            return True
        assert state == "CANCELLED", (index, before, state)
        self.held.pop(index, None)
        self.model.moved(index, "CANCELLED")
        return True

    def deadline(self) -> bool:
        due = [
            i for i in self.agreed("BLOCKED", "WAITING", "LEASED") if self.nodes[i].deadline and i not in self.started
        ]
        if not due:
            return False
        index = self.rng.choice(sorted(due))
        before = self.db_state(index)
        with an_hour_on():
            assert fail_for_deadline(self.nodes[index].id), (index, before)
        self.log.append(f"deadline t{index} ({before})")
        self.held.pop(index, None)
        self.model.moved(index, "FAILED")
        return True

    def follow_ups(self, whole: bool = True) -> bool:
        if not self.pending:
            return False
        for _ in range(50):
            run_follow_ups(settle, limit=1 if not whole else 100)
            if not whole or not DependencySettlement.objects.filter(namespace_id=self.tenant.namespace_id).exists():
                break
        self.log.append(f"follow-ups ({'all' if whole else 'one'})")
        return True

    def step(self, drain: bool = False) -> None:
        self.steps += 1
        actions: list[tuple[Callable[[], bool], float]] = [
            (self.submit_some if self.submitted < len(self.nodes) else (lambda: False), 3 if not drain else 10),
            (self.lease, 4),
            (self.end, 5),
            (lambda: self.review(drain), 2),
            (self.cancel_one, 2 if not drain else 1),
            (lambda: self.cancel_one(fan=True), 0.3 if not drain else 1),
            (self.deadline, 1),
            (lambda: self.follow_ups(whole=self.rng.random() < 0.7), 1.5 if not drain else 3),
        ]
        for _ in range(20):
            action = self.rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
            if action():
                STATS[
                    self.log[-1].split(" ")[0]
                    if not self.log[-1].startswith("t")
                    else " ".join(self.log[-1].split(" ")[1:2])
                ] += 1
                break
        self.check()

    # --- the checks ---

    def read(self) -> None:
        ns = self.tenant.namespace_id
        self.rows = {}
        for task_id, *rest in Task.objects.filter(namespace_id=ns).values_list(
            "id", "state", "blocked_by", "last_error", "on_dependency_failure", "cancel_requested", "finished_at"
        ):
            self.rows[self.index_of[task_id]] = tuple(rest)
        self.pending = set(DependencySettlement.objects.filter(namespace_id=ns).values_list("task_id", flat=True))

    def check(self) -> None:
        STATS["steps"] += 1
        if self.pending:
            STATS["steps with a follow-up pending"] += 1
        self.read()
        ns = self.tenant.namespace_id
        context = f"after step {self.steps}: {self.log[-6:]}"
        assert set(self.rows) == set(self.model.state), context
        # the state paths, read on from the last event seen
        events = Event.objects.filter(namespace_id=ns, type="task.state_changed", seq__gt=self.last_seq).order_by("seq")
        for seq, subject, data in events.values_list("seq", "subject_id", "data"):
            self.last_seq = seq
            index = self.index_of[subject]
            path = self.paths.setdefault(index, [])
            previous = data.get("previous")
            state = data["state"]
            assert (previous, state) in LEGAL_MOVES, (index, previous, state, path, context)
            assert previous == (path[-1][1] if path else None), (index, previous, state, path, context)
            assert not path or path[-1][1] not in FINAL, (f"t{index} moved on after ending", path, state, context)
            path.append((previous, state, seq))
            node = self.nodes[index]
            if state in FINAL:
                self.final_seq[index] = seq
            STATS[f"move {previous}->{state}"] += 1
            if state == "CANCELLED" and previous == "BLOCKED" and len(node.parents) > 1:
                STATS["a join cancelled"] += 1
            if state in ("WAITING", "LEASED") and previous in (None, "BLOCKED", "WAITING"):
                # only after every parent's ending, never after a failed one under CANCEL
                for p in node.parents:
                    assert p in self.final_seq and self.final_seq[p] < seq, (index, p, path, context)
                    if node.policy == "CANCEL":
                        assert self.paths[p][-1][1] == "SUCCEEDED", (index, p, self.paths[p], context)
        # the edges: blocked_by counts the unsettled ones
        edges: dict[int, list[tuple[int, bool]]] = {}
        for task_id, parent_id, settled in TaskDependency.objects.filter(namespace_id=ns).values_list(
            "task_id", "depends_on_id", "settled"
        ):
            edges.setdefault(self.index_of[task_id], []).append((self.index_of[parent_id], settled))
        for index, (state, blocked_by, last_error, policy, _, finished_at) in self.rows.items():
            node = self.nodes[index]
            assert (finished_at is not None) == (state in FINAL), (index, state, finished_at, context)
            if state in ("WAITING", "LEASED", "RUNNING"):
                assert blocked_by == 0, (index, state, blocked_by, context)
            assert sorted(p for p, _ in edges.get(index, [])) == node.parents, (index, context)
            assert policy == (node.policy if node.parents else policy), (index, policy, context)
            unsettled = [p for p, settled in edges.get(index, []) if not settled]
            for p in [p for p, settled in edges.get(index, [])]:
                parent_state = self.db_state(p)
                if parent_state in FINAL and self.nodes[p].id not in self.pending:
                    assert p not in unsettled, (f"edge t{p}->t{index} left unsettled", context)
            if state == "BLOCKED":
                assert blocked_by == len(unsettled), (index, blocked_by, unsettled, context)
                if not self.pending:
                    unended = [p for p in node.parents if self.db_state(p) not in FINAL]
                    assert blocked_by == len(unended) > 0, (f"t{index} BLOCKED", blocked_by, unended, context)
            # the model: equal, or (a follow-up pending) behind it, still BLOCKED
            expected = self.model.state[index]
            if self.pending:
                assert state == expected or (state == "BLOCKED" and expected in ("WAITING", "CANCELLED")), (
                    index,
                    state,
                    expected,
                    context,
                )
            else:
                assert state == expected, (f"t{index}", state, expected, node.parents, context)
            if state == "CANCELLED" and expected == "CANCELLED" and index in self.model.by_dependency:
                assert last_error and last_error["code"] == "DEPENDENCY_FAILED", (index, last_error, context)
                failed = self.index_of[last_error["task_id"]]
                assert failed in node.parents and self.db_state(failed) in FAILED_STATES, (index, last_error, context)
        for index, path in self.paths.items():
            finals = [s for _, s, _ in path if s in FINAL]
            assert len(finals) <= 1, (f"t{index} ended twice", path, context)
            assert path[-1][1] == self.rows[index][0], (index, path, self.rows[index], context)
        if len(self.nodes) <= 60 or self.steps % 10 == 0:
            assert_invariants()  # ~20 ms; a wide fan-out's graph now and then

    def finish(self) -> None:
        """Every non-fan task ended, the follow-ups drained: the model exactly, nothing left BLOCKED."""
        for _ in range(1000):
            if (
                self.submitted == len(self.nodes)
                and not self.pending
                and all(self.db_state(i) in FINAL for i in range(len(self.nodes)) if not self.nodes[i].fan)
            ):
                break
            self.step(drain=True)
        else:
            raise AssertionError(f"not drained: {self.log[-20:]}")
        self.follow_ups()
        self.steps = 0  # the invariants whatever the graph's size
        self.check()
        assert not self.pending
        for index, (state, *_rest) in self.rows.items():
            if state == "BLOCKED":
                assert any(self.db_state(p) not in FINAL for p in self.nodes[index].parents), index
        ids = [n.id for n in self.nodes]
        for task_id, path in moves_of(ids).items():
            assert Counter(state for state, _ in path)["CANCELLED"] <= 1, (task_id, path)


@pytest.mark.django_db
@pytest.mark.parametrize("seed", [f"seed-{n}" for n in range(FIRST_SEED, FIRST_SEED + SEEDS)])
def test_random_graphs_end_by_the_rules(tenant: Any, seed: str) -> None:
    run = Run(tenant, int(seed.split("-")[1]))
    run.read()
    # a prefix submitted before anything ends (a wide fan-out's members with it), the rest as it goes
    fan_end = max((n.index + 1 for n in run.nodes if n.fan), default=0)
    first = max(fan_end, int(len(run.nodes) * run.rng.uniform(0.3, 1.0)))
    while run.submitted < first:
        run.submit_some()
        run.check()
    size = len([n for n in run.nodes if not n.fan])
    for _ in range(run.rng.randint(size, 3 * size + 10)):
        if not any(s not in FINAL for s in run.model.state.values()) and run.submitted == len(run.nodes):
            break
        run.step()
    run.finish()
    STATS["seeds"] += 1
    STATS["tasks"] += len(run.nodes)
    STATS["edges"] += sum(len(n.parents) for n in run.nodes)
    if run.fans:
        STATS["seeds with a wide fan-out"] += 1
    if os.environ.get("ORBIT_RANDOM_GRAPH_STATS"):
        print(seed, dict(sorted(STATS.items())))


# --- real concurrency ------------------------------------------------------------

PARENTS = 6
TRIALS = int(os.environ.get("ORBIT_RANDOM_GRAPH_TRIALS", "2"))


def shared_dependents(rng: random.Random, wide: bool) -> tuple[list[Node], list[int]]:
    """PARENTS parents, then dependents sharing them (some on earlier dependents
    too: diamonds), a wide fan-out of the first parent when `wide` (its members
    in a queue of their own, some also on the second parent); last, the
    children submitted while the parents end. Returns the nodes and those
    children's indexes."""
    nodes = [Node(index=n, parents=[], policy="CANCEL", queue=0, priority=9) for n in range(PARENTS)]

    def add(parents: list[int], **fields: Any) -> None:
        fields.setdefault("policy", "RUN" if rng.random() < 0.35 else "CANCEL")
        fields.setdefault("key", rng.choice(["k/a", "k/b"]) if rng.random() < 0.3 else None)
        fields.setdefault("queue", 0)
        nodes.append(Node(index=len(nodes), parents=sorted(set(parents)), priority=0, **fields))

    for _ in range(14):
        parents = rng.sample(range(PARENTS), rng.randint(1, PARENTS))
        if len(nodes) > PARENTS and rng.random() < 0.5:
            parents += rng.sample(range(PARENTS, len(nodes)), rng.randint(1, min(3, len(nodes) - PARENTS)))
        add(parents)
    if wide:
        for n in range(INLINE_EDGES + 60):
            add([0, 1] if n % 5 == 2 else [0], queue=1, fan=True, key=None)
        members = [node.index for node in nodes if node.fan]
        for _ in range(3):  # below fan members: a cascade of a follow-up into another queue
            add([rng.choice(members), rng.randrange(PARENTS)])
    late = []
    for _ in range(3):
        late.append(len(nodes))
        add(rng.sample(range(len(nodes)), rng.randint(1, 3)))
    return nodes, late


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("trial", range(TRIALS))
def test_parents_ending_at_once_settle_their_shared_dependents_by_the_rules(tenant: Any, trial: int) -> None:
    rng = random.Random(5000 + trial)
    nodes, late = shared_dependents(rng, wide=trial % 2 == 1)
    run = Run(tenant, 5000 + trial, nodes, queues=1)  # q0, and q1 for a fan-out's members
    # given running parents, each leased by a worker of its own, and their dependents BLOCKED
    run.upto = PARENTS
    while run.submitted < PARENTS:
        run.submit_some()
    leases = {}
    for n in range(PARENTS):
        lease = lease_one(tenant, run.queues[0], worker_id=f"parent-{n}")
        start(lease)
        leases[run.index_of[lease["task"]["id"]]] = lease
    assert sorted(leases) == list(range(PARENTS))
    for index in leases:
        run.model.moved(index, "RUNNING")
    run.upto = late[0]
    while run.submitted < late[0]:
        run.submit_some()
    run.read()
    assert all(run.db_state(i) == "BLOCKED" for i in range(PARENTS, late[0]))
    outcomes = {index: rng.choice(["SUCCEEDED", "FAILED"]) for index in leases}
    cancelled = rng.sample([i for i in range(PARENTS, late[0]) if not nodes[i].fan], 3)
    gate = threading.Barrier(PARENTS + 3)
    ended = threading.Event()

    # when they all end at once, while the client cancels some dependents,
    # submits children of them, and follow-ups run
    def act(index: int) -> Any:
        if index < PARENTS:
            gate.wait(timeout=10)
            error = None if outcomes[index] == "SUCCEEDED" else {"code": "boom"}
            answer = report(leases[index], outcomes[index], output={"n": index}, error=error)
            assert answer["task_state"] == outcomes[index] and answer["duplicate"] is False, answer
            return None
        client = api_client(tenant.token)
        if index == PARENTS:
            gate.wait(timeout=10)
            for target in cancelled:
                response = cancel(client, nodes[target].id, f"cancel-{target}")
                assert response.status_code == 200, response.content
            return None
        if index == PARENTS + 1:
            gate.wait(timeout=10)
            created = []
            for child in late:
                node = nodes[child]
                depends_on = [nodes[p].id for p in node.parents]
                extra = {"on_dependency_failure": node.policy, "max_attempts": 1, "priority": 0}
                if node.key:
                    extra["concurrency_key"] = node.key
                created.append(submit_ok(client, run.queues[0], f"t{child}", depends_on=depends_on, **extra)["id"])
                node.id = created[-1]  # a later child may depend on it
            return created
        gate.wait(timeout=10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            run_follow_ups(settle)
            if ended.is_set() and not DependencySettlement.objects.exists():
                return None
            time.sleep(0.005)
        raise AssertionError("the follow-ups did not finish")

    def work(index: int) -> Any:
        try:
            return act(index)
        finally:
            if index <= PARENTS + 1:
                done.add(index)
                if len(done) == PARENTS + 2:
                    ended.set()

    done: set[int] = set()
    results = run_threads(PARENTS + 3, work, timeout=120)

    # then the states are the rules' (whatever the order), each task ended
    # once, nothing ran before its parents ended, blocked_by counts what is left
    for child, task_id in zip(late, results[PARENTS + 1], strict=True):
        nodes[child].id = task_id
        run.index_of[task_id] = child
        run.model.state[child] = "BLOCKED"
    run.submitted = len(nodes)
    for index, outcome in outcomes.items():
        run.model.moved(index, outcome)
    for index in cancelled:
        run.model.moved(index, "CANCELLED")
    wait_until(lambda: not DependencySettlement.objects.exists(), 10, what="the follow-ups")
    run.check()
    assert not run.pending
    for index in cancelled:
        assert run.db_state(index) == "CANCELLED"
    for _ in range(3):  # what is WAITING is leased, each with its parents' ends
        if run.lease():
            run.check()

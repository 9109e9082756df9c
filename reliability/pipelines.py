"""Pipelines in the chaos harness (SPEC §13): tasks that wait for tasks, under the same faults.

Alongside the harness's load, a thread submits a pipeline every few seconds, in turn:

- chains of CHAIN_LENGTH links (one batch, each link `depends_on` the one before by
  `ref:NAME`, or link by link, each its own POST /v1/tasks naming its parent's id, so that
  a link may arrive after its parent ended and be admitted WAITING or CANCELLED at once);
- fan-out/fan-in: a parent, FAN_CHILDREN children depending on it and a join depending on
  every child (one batch);
- a wide fan-out: a parent and WIDE_DEPENDENTS dependents, past the ending's inline budget
  (INLINE_EDGES), so their settlement finishes in the crash-safe follow-up.

Some parents (a chain's link, a fan's parent or one child) are marked to fail: the handler
fails every attempt (retryable, until max_attempts is used up) so the task ends FAILED; their
dependents wait under CANCEL (cancelled with DEPENDENCY_FAILED, transitively) or RUN (they run
once every dependency has finished). About a fifth of the tasks have a capacity-1 key, some
fail their first attempt (their dependents wait for the final one).

Two of the harness's kills cut a follow-up in flight (`cut_follow_up`): a parent kept WAITING
(available_at an hour away) with CASCADE_DEPENDENTS dependents (one in ten under RUN) is
cancelled through the server about to be killed, while the harness holds one dependent's row
lock past the inline budget: the follow-up that the cancel's commit nudges waits on that
row, holding the application's lock, when the server (or MariaDB) is killed. Another node
(or a server after the restart) must settle the rest from the DependencySettlement row.

At the end (`check`), from the rows: each pipeline task ended as its plan says (marked ones
FAILED, a dependent of a failed or cancelled one under CANCEL CANCELLED with last_error.code
DEPENDENCY_FAILED naming it, and never run; everything else SUCCEEDED); every dependent that
ran started after each of its dependencies had ended (the dependency's task finished_at and
its final attempt's finished_at; under CANCEL every dependency SUCCEEDED); its assignment
carried the dependencies' final states; depends_on as submitted; nothing BLOCKED, no
DependencySettlement row and no unsettled edge left. Figures: the pipelines by shape, the
dependents run and cancelled, and the readiness delay (from a dependent's BLOCKED → WAITING
event to the end of the last dependency that freed it).
"""

from __future__ import annotations

import collections
import datetime
import itertools
import json
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from reliability.checks import utc_ts

if TYPE_CHECKING:  # the harness runs as a script: no import of it at run time
    from reliability.harness import Harness, Server

# The edges one ending's transaction settles itself (tasks/actions/dependencies.py
# INLINE_EDGES); the rest go to the follow-up. A wide fan-out must be wider than this.
INLINE_EDGES = 200
CHAIN_LENGTH = 5
FAN_CHILDREN = 20
WIDE_DEPENDENTS = 300
CASCADE_DEPENDENTS = 600
# A wide fan-out with the pipeline of every this many turns (the first at the fourth).
WIDE_EVERY_TURNS = 40
# The dependent whose row the harness holds while a follow-up is cut: past the inline budget.
CASCADE_HELD_INDEX = INLINE_EDGES + 150
MAX_BATCH_ITEMS = 500  # POST /v1/tasks:batch
FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
FAILED_DEPENDENCY = ("FAILED", "CANCELLED")
# SPEC §13: a dependent is made ready within a second of the ending that frees it.
READY_WITHIN_SECONDS = 1.0
# A cut follow-up must be settled this long after the kill at the latest.
CUT_SETTLED_WITHIN_SECONDS = 30.0
REQUEST_TIMEOUT = httpx.Timeout(15.0, connect=2.0)
# information_schema.INNODB_TRX / INNODB_LOCK_WAITS come from a buffer InnoDB refreshes only
# when it was last read more than 0.1 s before: polled faster, they never change.
INNODB_INFO_REFRESH_SECONDS = 0.15


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, (str, bytes)) else value


@dataclass
class Planned:
    """One pipeline task as planned: what it waits for and how it must end."""

    idem: str
    pipeline: str
    shape: str  # chain | fan | wide | cascade
    role: str  # link | parent | child | join | dependent
    parents: list[str] = field(default_factory=list)  # idempotency keys, in depends_on order
    policy: str = "CANCEL"
    marked: bool = False  # the handler fails every attempt
    cancelled: bool = False  # the harness cancels it (a cut follow-up's parent)
    fail_first: bool = False
    key: str | None = None
    sleep_ms: int = 50
    queue: int = 0
    available_in_s: float | None = None


@dataclass
class Cut:
    """A follow-up held in flight at a kill (cut_follow_up)."""

    label: str
    parent: str  # task id
    held: str  # the dependent whose row the harness locks
    dependents: list[str]
    conn: Any
    owner: Pipelines
    figures: dict[str, Any] = field(default_factory=dict)
    killed_wall: float = 0.0

    def release(self) -> None:
        self.owner.release(self)

    def settled(self) -> dict[str, Any]:
        return self.owner.settled(self)


class Pipelines:
    def __init__(self, harness: Harness, database: str) -> None:
        self.h = harness
        self.database = database
        self.plan: dict[str, Planned] = {}  # by idempotency key, parents before dependents
        self.ids: dict[str, str] = {}  # idempotency key -> task id
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.sequence = itertools.count()
        self.shapes: collections.Counter = collections.Counter()
        self.batches = 0
        self.batch_retries = 0
        self.batch_worst_s = 0.0
        self.cuts: list[dict[str, Any]] = []
        self.resolved_reviews = 0

    # -- submitting ------------------------------------------------------------

    def _name(self, shape: str) -> str:
        return f"{shape}-{next(self.sequence):03d}"

    def _idem(self, pipeline: str, role: str) -> str:
        return f"chaos-{self.h.run_id}-pipe-{pipeline}-{role}"

    def _key(self, rng: random.Random, share: float = 0.2) -> str | None:
        return f"chaos/resource-{rng.randrange(self.h.cfg.keys)}" if rng.random() < share else None

    def _task(self, rng: random.Random, pipeline: str, shape: str, role: str, **fields: Any) -> Planned:
        planned = Planned(
            idem=self._idem(pipeline, role),
            pipeline=pipeline,
            shape=shape,
            role=role.rstrip("0123456789-"),
            queue=rng.randrange(2),
            sleep_ms=rng.randint(20, 150) if rng.random() > 0.1 else rng.randint(600, 1000),
            key=self._key(rng),
            fail_first=rng.random() < 0.08,
        )
        for name, value in fields.items():
            setattr(planned, name, value)
        if planned.marked:
            planned.fail_first = False
        return planned

    def body(self, planned: Planned, depends_on: list[str]) -> dict[str, Any]:
        payload: dict[str, Any] = {"idem": planned.idem, "pipe": planned.pipeline, "sleep_ms": planned.sleep_ms}
        if planned.marked:
            payload["fail_always"] = True
        if planned.fail_first:
            payload["fail_first"] = True
        body: dict[str, Any] = {
            "queue_id": self.h.queues[planned.queue % len(self.h.queues)],
            "handler": "chaos.work",
            "handler_version": "v1",
            "payload_version": "v1",
            "payload": payload,
            "priority": 5,
            "lease_seconds": self.h.cfg.lease_seconds,
            "max_attempts": 3,
            "retry": {"initial_seconds": 0.2, "multiplier": 2, "max_seconds": 1},
        }
        if depends_on:
            body["depends_on"] = depends_on
            body["on_dependency_failure"] = planned.policy
        if planned.key:
            body["concurrency_key"] = planned.key
        if planned.available_in_s is not None:
            at = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=planned.available_in_s)
            body["available_at"] = at.isoformat().replace("+00:00", "Z")
        return body

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.h.token}"}

    def _servers(self) -> list[Server]:
        return list(self.h.servers)

    def submit_batch(self, tasks: list[Planned]) -> bool:
        """One POST /v1/tasks:batch of planned tasks in order (parents in the same batch named by
        ref:NAME, earlier ones by id), re-sent whole to the other server after a 503, a 429 or a
        network error until every item is created or replayed."""
        refs = {planned.idem: f"t{index}" for index, planned in enumerate(tasks)}
        entries: list[dict[str, Any]] = []
        for planned in tasks:
            depends_on = [f"ref:{refs[p]}" if p in refs else self.ids[p] for p in planned.parents]
            entries.append(
                {"idempotency_key": planned.idem, "ref": refs[planned.idem], "task": self.body(planned, depends_on)}
            )
        with self.lock:
            for planned in tasks:
                self.plan[planned.idem] = planned
        servers = self._servers()
        submitter = self.h.submitter
        assert submitter is not None
        turn = next(self.sequence)
        for tries in itertools.count():
            if submitter.abandon.is_set():
                return False
            server = servers[(turn + tries) % len(servers)]
            began = time.monotonic()
            try:
                response = httpx.post(
                    server.url + "/v1/tasks:batch",
                    json={"tasks": entries},
                    headers=self._headers(),
                    timeout=REQUEST_TIMEOUT,
                )
            except httpx.HTTPError:
                self.batch_retries += 1
                time.sleep(0.3)
                continue
            self.batch_worst_s = max(self.batch_worst_s, time.monotonic() - began)
            if response.status_code in (429, 503):
                self.batch_retries += 1
                time.sleep(0.5)
                continue
            if response.status_code != 200:
                with submitter.stats.lock:
                    submitter.stats.unexpected.append(
                        f"pipeline batch to {server.name}: HTTP {response.status_code} {response.text[:300]}"
                    )
                return False
            results = response.json()["data"]["results"]
            if any(result["status"] in (429, 503) for result in results):
                self.batch_retries += 1  # an item refused for now: its later items may name it by ref
                time.sleep(0.5)
                continue
            refused = [result for result in results if result["status"] not in (200, 201)]
            if refused:
                with submitter.stats.lock:
                    submitter.stats.unexpected.append(f"pipeline batch to {server.name}: items refused {refused[:3]}")
                return False
            self.batches += 1
            with submitter.stats.lock:
                for planned, entry, result in zip(tasks, entries, results, strict=True):
                    submitter.stats.accepted[planned.idem] = result["task"]["id"]
                    submitter.stats.bodies[planned.idem] = entry["task"]
            with self.lock:
                for planned, result in zip(tasks, results, strict=True):
                    self.ids[planned.idem] = result["task"]["id"]
            return True
        return False

    def submit_single(self, planned: Planned) -> bool:
        """One POST /v1/tasks naming its parents by id (the submitters' path: retried with the
        same key and body to the other server)."""
        submitter = self.h.submitter
        assert submitter is not None
        with self.lock:
            self.plan[planned.idem] = planned
            depends_on = [self.ids[p] for p in planned.parents]
        body = self.body(planned, depends_on)
        with submitter.stats.lock:
            submitter.stats.bodies[planned.idem] = body
        with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
            data = submitter.post_until_answered(client, next(self.sequence), planned.idem, body)
        if data is None:
            return False
        with submitter.stats.lock:
            submitter.stats.accepted[planned.idem] = data["task"]["id"]
        with self.lock:
            self.ids[planned.idem] = data["task"]["id"]
        return True

    # -- the shapes ------------------------------------------------------------

    def chain(self, rng: random.Random, marked_at: int | None, policy: str, stepwise: bool) -> None:
        name = self._name("chain")
        links: list[Planned] = []
        for index in range(CHAIN_LENGTH):
            links.append(
                self._task(
                    rng,
                    name,
                    "chain",
                    f"link{index}",
                    parents=[links[-1].idem] if links else [],
                    policy=policy,
                    marked=index == marked_at,
                )
            )
        self.shapes["chains_stepwise" if stepwise else "chains"] += 1
        if not stepwise:
            self.submit_batch(links)
            return
        for link in links:  # each after a pause: its parent may have ended by then
            if not self.submit_single(link):
                return
            self.stop.wait(rng.uniform(0.1, 0.8))

    def fan(self, rng: random.Random, marked: str | None, child_policy: str, join_policy: str) -> None:
        """A parent, FAN_CHILDREN children and a join; `marked`: 'parent', 'child' or None."""
        name = self._name("fan")
        parent = self._task(rng, name, "fan", "parent", marked=marked == "parent")
        failing_child = rng.randrange(FAN_CHILDREN)
        children = [
            self._task(
                rng,
                name,
                "fan",
                f"child-{index}",
                parents=[parent.idem],
                policy=child_policy,
                marked=marked == "child" and index == failing_child,
            )
            for index in range(FAN_CHILDREN)
        ]
        join = self._task(rng, name, "fan", "join", parents=[c.idem for c in children], policy=join_policy)
        self.shapes["fan_ins"] += 1
        self.submit_batch([parent, *children, join])

    def wide(self, rng: random.Random) -> None:
        name = self._name("wide")
        parent = self._task(rng, name, "wide", "parent", key=None, fail_first=False, sleep_ms=300)
        dependents = [
            self._task(
                rng,
                name,
                "wide",
                f"dependent-{index}",
                parents=[parent.idem],
                policy="CANCEL" if index % 2 else "RUN",
                key=self._key(rng, 0.1),
                sleep_ms=rng.randint(10, 40),
                fail_first=False,
            )
            for index in range(WIDE_DEPENDENTS)
        ]
        self.shapes["wide_fan_outs"] += 1
        self.submit_batch([parent, *dependents])

    def turns(self, rng: random.Random) -> list[Any]:
        return [
            lambda: self.chain(rng, None, "CANCEL", stepwise=False),
            lambda: self.fan(rng, None, "CANCEL", "CANCEL"),
            lambda: self.chain(rng, 2, "CANCEL", stepwise=False),
            lambda: self.fan(rng, "parent", "CANCEL", "CANCEL"),
            lambda: self.chain(rng, 1, "RUN", stepwise=True),
            lambda: self.fan(rng, "parent", "RUN", "CANCEL"),
            lambda: self.chain(rng, None, "CANCEL", stepwise=True),
            lambda: self.fan(rng, "child", "CANCEL", "CANCEL"),
            lambda: self.chain(rng, 0, "CANCEL", stepwise=True),
            lambda: self.fan(rng, "child", "CANCEL", "RUN"),
            lambda: self.chain(rng, 3, "RUN", stepwise=False),
        ]

    def loop(self) -> None:
        rng = random.Random(self.h.cfg.seed * 1000 + 777)
        turns = self.turns(rng)
        every = self.h.cfg.pipeline_every
        for turn in itertools.count():
            if self.stop.wait(every if turn else 1.0):
                return
            try:
                if turn % WIDE_EVERY_TURNS == 3:
                    self.wide(rng)
                turns[turn % len(turns)]()
            except Exception as exc:  # noqa: BLE001 - a harness fault, reported as a violation
                self.h.violation(f"pipelines: submitting failed: {type(exc).__name__}: {exc}")
                return

    def start(self) -> None:
        self.thread = threading.Thread(target=self.loop, name="pipelines", daemon=True)
        self.thread.start()

    def finish(self, timeout: float) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout)

    # -- a follow-up cut by a kill ---------------------------------------------

    def cut_follow_up(self, server: Server, label: str) -> Cut | None:
        """A cancel through `server` that leaves a follow-up, held in flight: the caller kills
        (the server or MariaDB), then calls `release` and, once things are back, `settled`."""
        rng = random.Random(self.h.cfg.seed * 1000 + 555 + len(self.cuts))
        name = self._name("cascade")
        parent = self._task(rng, name, "cascade", "parent", cancelled=True, key=None, available_in_s=3600.0)
        dependents = [
            self._task(
                rng,
                name,
                "cascade",
                f"dependent-{index}",
                parents=[parent.idem],
                policy="RUN" if index % 10 == 0 else "CANCEL",
                key=self._key(rng, 0.05),
                sleep_ms=rng.randint(10, 40),
                fail_first=False,
            )
            for index in range(CASCADE_DEPENDENTS)
        ]
        self.shapes["cut_follow_ups"] += 1
        first = [parent, *dependents[: MAX_BATCH_ITEMS - 1]]
        if not self.submit_batch(first) or not self.submit_batch(dependents[MAX_BATCH_ITEMS - 1 :]):
            self.h.violation(f"{label}: the cut follow-up's pipeline could not be submitted")
            return None
        parent_id = self.ids[parent.idem]
        held = self.ids[dependents[CASCADE_HELD_INDEX].idem]
        conn = self.h.db.connect(self.database)
        cut = Cut(label, parent_id, held, [self.ids[d.idem] for d in dependents], conn, self)
        cursor = conn.cursor()
        cursor.execute("SELECT id FROM orbit_task WHERE id=%s FOR UPDATE", (held,))
        own_trx = None
        for _ in range(40):
            if own_trx is not None:
                break
            # InnoDB refreshes these tables' buffer only when it was last read over 0.1 s ago.
            time.sleep(INNODB_INFO_REFRESH_SECONDS)
            cursor.execute("SELECT trx_id FROM information_schema.INNODB_TRX WHERE trx_mysql_thread_id=CONNECTION_ID()")
            own_trx = (cursor.fetchone() or [None])[0]
        if own_trx is None:
            self.h.violation(f"{label}: the harness's row lock on {held} shows in no InnoDB transaction")
            self.release(cut)
            return None
        began = time.monotonic()
        status, text = None, ""
        for _ in range(5):  # the same key again after a 503 or a lost answer: one cancel
            try:
                response = httpx.post(
                    f"{server.url}/v1/tasks/{parent_id}:cancel",
                    json={"reason": "chaos: a follow-up cut by a kill"},
                    headers={**self._headers(), "Idempotency-Key": f"chaos-{self.h.run_id}-cancel-{name}"},
                    timeout=REQUEST_TIMEOUT,
                )
            except httpx.HTTPError as exc:
                status, text = None, type(exc).__name__
                continue
            status, text = response.status_code, response.text[:300]
            if status != 503:
                break
            time.sleep(0.3)
        if status != 200:
            self.h.violation(f"{label}: cancelling {parent_id} through server {server.name} answered {status} {text}")
            self.release(cut)
            return None

        waiter: list[str] = []

        def waiting_on_us() -> bool:
            rows = self.h.query(
                "SELECT p.HOST FROM information_schema.INNODB_LOCK_WAITS w "
                "JOIN information_schema.INNODB_TRX t ON t.trx_id=w.requesting_trx_id "
                "JOIN information_schema.PROCESSLIST p ON p.ID=t.trx_mysql_thread_id WHERE w.blocking_trx_id=%s",
                (own_trx,),
            )
            waiter[:] = [row[0] for row in rows]
            return bool(rows)

        # Bounded: on a loaded machine the follow-up may take seconds to come round.
        caught = self.h.wait_until(waiting_on_us, timeout=15.0, interval=INNODB_INFO_REFRESH_SECONDS)
        pending = self.h.query("SELECT COUNT(*) FROM orbit_dependency_settlement WHERE task_id=%s", (parent_id,))[0][0]
        blocked = self._blocked_of(cut)
        cut.figures.update(
            {
                "dependents": len(dependents),
                "follow_up_waiting_at_kill": caught is not None,
                "follow_up_held_on": self._node_of(waiter[0]) if waiter else None,
                "settlement_pending_at_kill": bool(pending),
                "blocked_at_kill": blocked,
                "cancel_to_kill_s": round(time.monotonic() - began, 2),
            }
        )
        if not pending or blocked != len(dependents) - INLINE_EDGES:
            self.h.violation(
                f"{label}: after the cancel of {parent_id}, {blocked} of {len(dependents)} dependents BLOCKED and "
                f"settlement pending {bool(pending)} (want {len(dependents) - INLINE_EDGES} left to the follow-up)"
            )
        cut.killed_wall = time.time()
        return cut

    def _node_of(self, host: str) -> str | None:
        """Which server node a MariaDB client connection ("127.0.0.1:PORT") belongs to: the
        process whose socket has that local port, one of a node's processes."""
        port = int(host.rsplit(":", 1)[1]) if ":" in host else None
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = Path(table).read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
        for server in self.h.every_server:
            if server.process is None:
                continue
            pids = [server.process.pid]
            try:
                pids += [int(pid) for pid in Path(f"/proc/{pids[0]}/task/{pids[0]}/children").read_text().split()]
            except OSError:
                continue
            for pid in pids:
                try:
                    links = {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
                except OSError:
                    continue
                if links & inodes:
                    return server.name
        return None

    def _blocked_of(self, cut: Cut) -> int:
        marks = ",".join(["%s"] * len(cut.dependents))
        rows = self.h.query(
            f"SELECT COUNT(*) FROM orbit_task WHERE state='BLOCKED' AND id IN ({marks})", tuple(cut.dependents)
        )
        return int(rows[0][0])

    def release(self, cut: Cut) -> None:
        """After the kill: the harness lets go of the dependent's row (its connection may be gone
        with MariaDB)."""
        try:
            cut.conn.rollback()
            cut.conn.close()
        except Exception:  # noqa: BLE001 - killed with the database
            pass

    def settled(self, cut: Cut) -> dict[str, Any]:
        """Waits (bounded) until a node settled the rest: no dependent BLOCKED, no settlement row."""

        def done() -> bool:
            pending = self.h.query("SELECT COUNT(*) FROM orbit_dependency_settlement WHERE task_id=%s", (cut.parent,))
            return pending[0][0] == 0 and self._blocked_of(cut) == 0

        self.h.wait_until(done, timeout=CUT_SETTLED_WITHIN_SECONDS, interval=0.2)
        after = time.time() - cut.killed_wall
        ok = done()
        cut.figures["settled_after_kill_s"] = round(after, 2) if ok else None
        if not ok:
            self.h.violation(
                f"{cut.label}: the follow-up of cancelled {cut.parent} was not finished "
                f"{CUT_SETTLED_WITHIN_SECONDS:g} s after the kill ({self._blocked_of(cut)} dependents still BLOCKED)"
            )
        self.cuts.append(cut.figures)
        return cut.figures

    # -- the end -----------------------------------------------------------------

    def resolve_reviews(self) -> int:
        """Moves NEEDS_REVIEW pipeline tasks (a kill left their effect unknown) on with RETRY, as
        an operator would; a dependent waits for that (SPEC §13). Returns how many were moved."""
        rows = self.h.query(
            "SELECT id, attempts FROM orbit_task WHERE namespace_id=%s AND state='NEEDS_REVIEW' "
            "AND JSON_EXTRACT(payload, '$.pipe') IS NOT NULL",
            (self.h.namespace_id,),
        )
        moved = 0
        for task_id, attempts in rows:
            server = self.h.servers[moved % len(self.h.servers)]
            try:
                response = httpx.post(
                    f"{server.url}/v1/tasks/{task_id}:resolve",
                    json={"resolution": "RETRY", "reason": "chaos: its worker was killed"},
                    headers={
                        **self._headers(),
                        "Idempotency-Key": f"chaos-{self.h.run_id}-resolve-{task_id}-{attempts}",
                    },
                    timeout=REQUEST_TIMEOUT,
                )
            except httpx.HTTPError:
                continue
            if response.status_code == 200:
                moved += 1
            elif response.status_code != 503:
                self.h.violation(f"resolving {task_id} RETRY answered {response.status_code} {response.text[:300]}")
        self.resolved_reviews += moved
        return moved

    def expected_states(self) -> dict[str, str]:
        """How each planned task must end: cancelled by the harness, or by a failed or cancelled
        dependency under CANCEL; else FAILED if marked; else SUCCEEDED."""
        expected: dict[str, str] = {}
        for idem, planned in self.plan.items():  # parents before dependents
            parents = [expected.get(p) for p in planned.parents]
            if planned.cancelled:
                expected[idem] = "CANCELLED"
            elif planned.policy == "CANCEL" and any(state in FAILED_DEPENDENCY for state in parents):
                expected[idem] = "CANCELLED"
            elif planned.marked:
                expected[idem] = "FAILED"
            else:
                expected[idem] = "SUCCEEDED"
        return expected

    def check(self, ledgers_dir: Path) -> tuple[list[str], dict[str, Any]]:
        """The end checks over the quiet rows; (violations, figures)."""
        h = self.h
        found: list[str] = []
        tasks = {
            r[0]: {
                "id": r[0],
                "state": r[1],
                "depends_on": _json(r[2]),
                "policy": r[3],
                "last_error": _json(r[4]),
                "finished_at": utc_ts(r[5]),
                "idem": r[6],
            }
            for r in h.query(
                "SELECT id, state, depends_on, on_dependency_failure, last_error, finished_at, "
                "JSON_UNQUOTE(JSON_EXTRACT(payload, '$.idem')) FROM orbit_task "
                "WHERE namespace_id=%s AND JSON_EXTRACT(payload, '$.pipe') IS NOT NULL",
                (h.namespace_id,),
            )
        }
        attempts: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for r in h.query(
            "SELECT a.task_id, a.id, a.epoch, a.state, a.leased_at, a.started_at, a.finished_at "
            "FROM orbit_attempt a JOIN orbit_task t ON t.id=a.task_id "
            "WHERE t.namespace_id=%s AND JSON_EXTRACT(t.payload, '$.pipe') IS NOT NULL",
            (h.namespace_id,),
        ):
            attempts[r[0]].append(
                {
                    "id": r[1],
                    "epoch": r[2],
                    "state": r[3],
                    "leased_at": utc_ts(r[4]),
                    "started_at": utc_ts(r[5]),
                    "finished_at": utc_ts(r[6]),
                }
            )
        for own in attempts.values():
            own.sort(key=lambda a: a["epoch"])
        ready_at: dict[str, float] = {}
        for subject, created in h.query(
            "SELECT subject_id, created_at FROM orbit_event WHERE namespace_id=%s AND type='task.state_changed' "
            "AND JSON_UNQUOTE(JSON_EXTRACT(data, '$.previous'))='BLOCKED' "
            "AND JSON_UNQUOTE(JSON_EXTRACT(data, '$.state'))='WAITING'",
            (h.namespace_id,),
        ):
            at = utc_ts(created)
            assert at is not None
            ready_at[subject] = min(at, ready_at.get(subject, at))

        def ended(task_id: str) -> float | None:
            """When a dependency ended: its task's finished_at, and no earlier than its final attempt's end."""
            task = tasks.get(task_id)
            if task is None or task["finished_at"] is None:
                return None
            last = attempts.get(task_id, [])
            final_attempt = last[-1]["finished_at"] if last and last[-1]["finished_at"] is not None else 0.0
            return max(task["finished_at"], final_attempt)

        # Nothing left behind, anywhere in the namespace.
        blocked = h.query(
            "SELECT id FROM orbit_task WHERE namespace_id=%s AND state='BLOCKED' LIMIT 20", (h.namespace_id,)
        )
        if blocked:
            found.append(f"pipelines: tasks left BLOCKED at the end: {[r[0] for r in blocked]}")
        settlements = h.query("SELECT task_id, created_at FROM orbit_dependency_settlement")
        if settlements:
            found.append(f"pipelines: DependencySettlement rows left at the end: {settlements[:5]}")
        unsettled = h.query(
            "SELECT task_id, depends_on_id FROM orbit_task_dependency WHERE namespace_id=%s AND NOT settled LIMIT 10",
            (h.namespace_id,),
        )
        if unsettled:
            found.append(f"pipelines: dependency edges never settled (dependent, dependency): {unsettled}")

        expected = self.expected_states()
        figures: collections.Counter = collections.Counter()
        by_role: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        delays: list[float] = []
        wide_delays: list[float] = []
        cut_delays: list[float] = []  # held on purpose by cut_follow_up: apart
        for idem, planned in self.plan.items():
            task_id = self.ids.get(idem)
            if task_id is None:
                continue  # never acknowledged (the run ended mid-retry): counted by the harness's own checks
            task = tasks.get(task_id)
            if task is None:
                found.append(f"pipeline {planned.pipeline}: task {task_id} ({planned.role}) is not in orbit_task")
                continue
            state = task["state"]
            want = expected[idem]
            by_role[f"{planned.shape} {planned.role}"][state] += 1
            where = f"pipeline {planned.pipeline}: {planned.role} {task_id} ({planned.policy})"
            if state != want:
                found.append(f"{where} ended {state}, want {want} (last_error {task['last_error']})")
            parent_ids = [self.ids.get(p, "?") for p in planned.parents]
            if (task["depends_on"] or []) != parent_ids:
                found.append(f"{where}: depends_on {task['depends_on']} but submitted {parent_ids}")
            if not parent_ids:
                continue
            parents = [tasks.get(p) for p in parent_ids]
            failed = [p for p in parents if p is not None and p["state"] in FAILED_DEPENDENCY]
            ran = [a for a in attempts.get(task_id, []) if a["started_at"] is not None]
            leased = attempts.get(task_id, [])
            if planned.policy == "CANCEL" and failed:
                code = (task["last_error"] or {}).get("code")
                named = (task["last_error"] or {}).get("task_id")
                if state != "CANCELLED" or code != "DEPENDENCY_FAILED" or named not in {p["id"] for p in failed}:
                    found.append(
                        f"{where}: dependency {failed[0]['id']} ended {failed[0]['state']}, yet it is {state} with "
                        f"last_error {task['last_error']} (want CANCELLED, DEPENDENCY_FAILED naming a failed one)"
                    )
                if leased:
                    found.append(
                        f"{where}: leased {len(leased)} times (first at {leased[0]['leased_at']:.6f}) although "
                        f"dependency {failed[0]['id']} ended {failed[0]['state']} at {failed[0]['finished_at']}"
                    )
                figures["dependents_cancelled_dependency_failed"] += (
                    state == "CANCELLED" and code == "DEPENDENCY_FAILED"
                )
            for attempt in ran:
                for parent_id, parent in zip(parent_ids, parents, strict=True):
                    end = ended(parent_id)
                    good = FINAL if planned.policy == "RUN" else ("SUCCEEDED",)
                    if parent is None or parent["state"] not in good or end is None or attempt["started_at"] < end:
                        found.append(
                            f"{where}: attempt {attempt['id']} started at {attempt['started_at']:.6f} (leased at "
                            f"{attempt['leased_at']:.6f}) but dependency {parent_id} is "
                            f"{None if parent is None else parent['state']} ended at {end}"
                        )
            if ran:
                figures["dependents_ran"] += 1
                figures["dependents_ran_after_a_failed_dependency"] += bool(failed)
            ends = [ended(p) for p in parent_ids]
            if task_id in ready_at and all(e is not None for e in ends):
                delay = ready_at[task_id] - max(e for e in ends if e is not None)
                (cut_delays if planned.shape == "cascade" else delays).append(delay)
                if planned.shape == "wide":
                    wide_delays.append(delay)
                if delay < -0.001:
                    found.append(
                        f"{where}: made ready (BLOCKED -> WAITING) at {ready_at[task_id]:.6f}, {-delay:.3f} s before "
                        f"its last dependency ended"
                    )
        found += self.check_assignments(ledgers_dir, tasks)
        chains = collections.defaultdict(list)
        for idem, planned in self.plan.items():
            if planned.shape == "chain" and idem in self.ids:
                chains[planned.pipeline].append(tasks.get(self.ids[idem], {}).get("state"))
        joins = [
            tasks.get(self.ids.get(idem, ""), {}).get("state")
            for idem, planned in self.plan.items()
            if planned.role == "join"
        ]
        ordered = sorted(delays)
        result = {
            "pipelines": {
                **dict(sorted(self.shapes.items())),
                "tasks": len(self.plan),
                "batches": self.batches,
                "batch_retries": self.batch_retries,
                "batch_worst_s": round(self.batch_worst_s, 2),
                "reviews_resolved_retry": self.resolved_reviews,
            },
            "pipeline_outcomes": {
                "chains_completed": sum(all(s == "SUCCEEDED" for s in states) for states in chains.values()),
                "chains_cut_short": sum(any(s == "CANCELLED" for s in states) for states in chains.values()),
                "joins_ran": sum(1 for s in joins if s == "SUCCEEDED"),
                "joins_cancelled": sum(1 for s in joins if s == "CANCELLED"),
                **dict(sorted(figures.items())),
            },
            "pipeline_readiness": {
                "measured": len(delays),
                "p50_s": round(statistics.median(ordered), 3) if ordered else None,
                "p99_s": round(ordered[int(0.99 * (len(ordered) - 1))], 3) if ordered else None,
                "max_s": round(ordered[-1], 3) if ordered else None,
                "wide_max_s": round(max(wide_delays), 3) if wide_delays else None,
                "cut_follow_up_max_s": round(max(cut_delays), 3) if cut_delays else None,
                f"over_{READY_WITHIN_SECONDS:g}_s": sum(1 for d in delays if d > READY_WITHIN_SECONDS),
            },
            "pipeline_states_by_role": {role: dict(sorted(c.items())) for role, c in sorted(by_role.items())},
            "pipeline_cut_follow_ups": self.cuts,
        }
        return found, result

    def check_assignments(self, ledgers_dir: Path, tasks: dict[str, dict]) -> list[str]:
        """Each dependent's execution was told its dependencies in depends_on order, each in its
        final state, with an output for those that succeeded (the chaos handler returns one)."""
        found = []
        for path in sorted(ledgers_dir.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                if '"dependencies"' not in line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # cut by kill -9
                task = tasks.get(record["task_id"])
                if task is None:
                    continue
                told = record["dependencies"]
                if [d["task_id"] for d in told] != (task["depends_on"] or []):
                    found.append(f"attempt {record['attempt_id']}: assignment's dependencies {told} != depends_on")
                    continue
                for dependency in told:
                    actual = tasks.get(dependency["task_id"], {}).get("state")
                    if dependency["state"] != actual or actual not in FINAL:
                        found.append(
                            f"attempt {record['attempt_id']} of {record['task_id']}: told dependency "
                            f"{dependency['task_id']} was {dependency['state']} (it ended {actual})"
                        )
                    if dependency["state"] == "SUCCEEDED" and not dependency["output"]:
                        found.append(
                            f"attempt {record['attempt_id']}: succeeded dependency {dependency['task_id']} "
                            "came without its output"
                        )
        return found[:20]

    def inject_faults(self, cursor: Any) -> None:
        """--inject-faults: the rows a dependency bug would leave, so each end check above fires."""
        # A dependent cancelled for a failed dependency, with another code.
        cursor.execute(
            "UPDATE orbit_task SET last_error=JSON_SET(last_error, '$.code', 'INJECTED') WHERE namespace_id=%s "
            "AND state='CANCELLED' AND JSON_UNQUOTE(JSON_EXTRACT(last_error, '$.code'))='DEPENDENCY_FAILED' LIMIT 1",
            (self.h.namespace_id,),
        )
        # A dependent started before its dependency ended.
        cursor.execute(
            "SELECT a.id, JSON_UNQUOTE(JSON_EXTRACT(t.depends_on, '$[0]')) FROM orbit_attempt a JOIN orbit_task t "
            "ON t.id=a.task_id WHERE t.namespace_id=%s AND t.depends_on IS NOT NULL AND a.state='SUCCEEDED' LIMIT 1",
            (self.h.namespace_id,),
        )
        attempt_id, parent_id = cursor.fetchone()
        cursor.execute(
            "UPDATE orbit_attempt SET started_at=(SELECT finished_at - INTERVAL 1 SECOND FROM orbit_task WHERE id=%s) "
            "WHERE id=%s",
            (parent_id, attempt_id),
        )
        # A join left BLOCKED, an edge left unsettled, a settlement left behind.
        cursor.execute(
            "UPDATE orbit_task SET state='BLOCKED' WHERE namespace_id=%s AND state='SUCCEEDED' "
            "AND JSON_LENGTH(depends_on) > 1 LIMIT 1",
            (self.h.namespace_id,),
        )
        cursor.execute(
            "UPDATE orbit_task_dependency SET settled=0 WHERE namespace_id=%s LIMIT 1", (self.h.namespace_id,)
        )
        cursor.execute(
            "INSERT INTO orbit_dependency_settlement (task_id, namespace_id, application_id, created_at) "
            "SELECT id, namespace_id, application_id, NOW(6) FROM orbit_task WHERE namespace_id=%s AND has_dependents "
            "AND state='SUCCEEDED' LIMIT 1",
            (self.h.namespace_id,),
        )

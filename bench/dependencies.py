"""Dependencies at the sizes SPEC §13 names: how soon a freed task is ready, and
how long the settlement of a wide fan-out holds its transactions.

Starts a private MariaDB with performance_schema on (transactions and statements
kept in its history tables) and this checkout's Orbit server on it
(bench/private_orbit.py, maintenance on: the follow-up settlement runs there),
then three shapes, each in a queue of its own, loaded while no worker runs and
then drained by SDK worker processes (a handler that returns at once):

- chain: `--chain` tasks, each depending on the one before;
- fan-out: `--fan-out` tasks depending on one root (the root's ending settles
  INLINE_EDGES edges itself and leaves the rest to follow-up transactions of
  FOLLOW_UP_CHUNK edges, tasks/actions/dependencies.py);
- fan-in: `--joins` joins, each depending on `--fan-in` children of its own.

For every dependent, from the ending that freed it (its dependency's
`finished_at`, the latest one's for a join) to:

- ready: the `task.state_changed` BLOCKED → WAITING event the settlement writes
  in its transaction (`orbit_event.created_at`; the commit follows within that
  transaction's remaining time, bounded by the transaction figures below);
- leased / started: its first attempt's `leased_at` / `started_at` (a fan-out's
  10,000 are drained by the workers, so these show the drain, not readiness).

SPEC §13: each ready within a second of the ending that frees it.

Transactions, from MariaDB's side (performance_schema's
events_transactions_history_long, polled every 0.2 s; a settling transaction is
one with an `UPDATE orbit_task_dependency`): each one's duration, and how long
it held the application's counter row (orbit_application_state, locked FOR
UPDATE first: from that statement's end to the commit's end; the statement's
own time is the wait for it). The inline one is the root's ending (a worker's
round), the follow-ups are the maintenance thread's chunks. Transactions of
other connections overlapping the settlement are reported beside them.

    .venv/bin/python -m bench.dependencies            # 1,000 / 10,000 / 1,000 (×3 joins)
    .venv/bin/python -m bench.dependencies --quick    # a smoke run: seconds
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import percentile
from bench.private_orbit import PrivateOrbit, private_orbit

ROOT = Path(__file__).resolve().parent.parent
BATCH = 500  # POST /v1/tasks:batch takes at most this many
READY_WITHIN_S = 1.0  # SPEC §13
HISTORY_ROWS = 50_000  # performance_schema history sizes; polled well before they wrap
POLL_SECONDS = 0.2

SIZES = {
    "full": {"chain": 1000, "fan_out": 10_000, "fan_in": 1000, "joins": 3},
    # past the inline budget (200) and into one follow-up chunk (500)
    "quick": {"chain": 20, "fan_out": 600, "fan_in": 50, "joins": 2},
}

MARIADB_ARGS = (
    "--performance-schema=ON",
    "--performance-schema-instrument=transaction=ON",
    "--performance-schema-consumer-events-transactions-current=ON",
    "--performance-schema-consumer-events-transactions-history-long=ON",
    "--performance-schema-consumer-events-statements-current=ON",
    "--performance-schema-consumer-events-statements-history-long=ON",
    f"--performance-schema-events-transactions-history-long-size={HISTORY_ROWS}",
    f"--performance-schema-events-statements-history-long-size={HISTORY_ROWS}",
    "--performance-schema-max-sql-text-length=2048",
)

WORKER_SOURCE = """
import sys

import orbit_sdk

url, token, queue_id, capacity = sys.argv[1:5]


async def handler(execution):
    return None


worker = orbit_sdk.Worker(url, token, [queue_id], {"dep": handler}, capacity=int(capacity), concurrency_keys=False)
print("ready", flush=True)
worker.run()
"""

# Statements that mark a transaction: it settles edges, it ends attempts (a
# worker's round, the inline settlement's), or it takes the counter row. A
# multi-statement query is one event per statement, each with the text from
# that statement on; a transaction's event starts after its first statement
# (here the counter row's locking read), which is then not nested in it.
# Each statement is kept as its kind (statement_kind).
SETTLES = "UPDATE orbit_task_dependency"
ENDS_ATTEMPTS = "UPDATE orbit_attempt"
COUNTER_ROW = "SELECT orbit_application_state"
COUNTER_ROW_LIKE = "SELECT % FROM `orbit_application_state` WHERE"


# ---------------------------------------------------------------- performance_schema


@dataclass
class Transaction:
    thread: int
    start: int  # picoseconds, performance_schema's timer
    end: int
    state: str
    settles: bool = False
    ends_attempts: bool = False
    counter_locked: tuple[int, int] | None = None  # the locking read's start and end
    statements: list[tuple[int, int, str]] = field(default_factory=list)  # start, end, kind

    @property
    def ms(self) -> float:
        return (self.end - self.start) / 1e9

    @property
    def counter_held_ms(self) -> float | None:
        return None if self.counter_locked is None else (self.end - self.counter_locked[1]) / 1e9

    @property
    def counter_wait_ms(self) -> float | None:
        if self.counter_locked is None:
            return None
        return (self.counter_locked[1] - self.counter_locked[0]) / 1e9


@dataclass
class HistoryPoller:
    """Copies the finished transactions and the marking statements out of
    performance_schema's history tables every POLL_SECONDS, so a ring buffer
    that wraps during a phase loses nothing; `wrapped` says if one wrapped
    between two polls all the same."""

    orbit: PrivateOrbit
    transactions: dict[tuple[int, int], Transaction] = field(default_factory=dict)
    statements: dict[tuple[int, int], tuple[int | None, int, int, str]] = field(default_factory=dict)
    wrapped: bool = False
    offsets: list[float] = field(default_factory=list)  # wall clock (epoch s) minus the timer, in s
    _stop: threading.Event = field(default_factory=threading.Event)
    _last_end: dict[str, int] = field(default_factory=dict)
    _seen: dict[str, int] = field(default_factory=dict)  # the latest TIMER_END copied, per table

    def run(self) -> None:
        connection = self.orbit.db.connect()
        connection.autocommit(True)
        cursor = connection.cursor()
        cursor.execute("SELECT THREAD_ID FROM performance_schema.threads WHERE PROCESSLIST_ID = CONNECTION_ID()")
        (own,) = cursor.fetchone()
        try:
            while True:
                stopping = self._stop.wait(POLL_SECONDS)
                self._poll(cursor, own)
                if stopping:
                    return
        finally:
            connection.close()

    def _poll(self, cursor: Any, own: int) -> None:
        # The timer against the wall clock: NOW(6) is read as its statement starts.
        cursor.execute("SELECT UNIX_TIMESTAMP(NOW(6)) /* bench clock */")
        (wall,) = cursor.fetchone()
        cursor.execute(
            "SELECT TIMER_START FROM performance_schema.events_statements_history_long"
            f" WHERE THREAD_ID = {int(own)} AND SQL_TEXT LIKE 'SELECT UNIX_TIMESTAMP(NOW(6)) /* bench clock */'"
            " ORDER BY EVENT_ID DESC LIMIT 1"
        )
        timer = cursor.fetchone()
        if timer is not None:
            self.offsets.append(float(wall) - timer[0] / 1e12)
        for table in ("transactions", "statements"):
            cursor.execute(
                f"SELECT MIN(TIMER_START), MAX(TIMER_END) FROM performance_schema.events_{table}_history_long"
            )
            oldest, newest = cursor.fetchone()
            if oldest is not None and table in self._last_end and oldest > self._last_end[table]:
                self.wrapped = True
            if newest is not None:
                self._last_end[table] = newest
        # No parameters: MySQLdb leaves the LIKE patterns' % alone. Rows finished since
        # a second before the last poll (a row enters the history as it finishes).
        since = {table: max(0, end - 10**12) for table, end in self._seen.items()}
        cursor.execute(
            "SELECT THREAD_ID, EVENT_ID, TIMER_START, TIMER_END, STATE"
            " FROM performance_schema.events_transactions_history_long"
            f" WHERE THREAD_ID <> {int(own)} AND TIMER_END > {since.get('transactions', 0)}"
        )
        for thread, event, start, end, state in cursor.fetchall():
            self.transactions.setdefault((thread, event), Transaction(thread, start, end, state))
            self._seen["transactions"] = max(self._seen.get("transactions", 0), end)
        cursor.execute(
            "SELECT THREAD_ID, EVENT_ID, NESTING_EVENT_ID, TIMER_START, TIMER_END, SQL_TEXT"
            " FROM performance_schema.events_statements_history_long"
            f" WHERE THREAD_ID <> {int(own)} AND TIMER_END > {since.get('statements', 0)}"
            f" AND (NESTING_EVENT_TYPE = 'TRANSACTION' OR SQL_TEXT LIKE '{COUNTER_ROW_LIKE}%')"
        )
        for thread, event, nesting, start, end, text in cursor.fetchall():
            self.statements.setdefault((thread, event), (nesting, start, end, statement_kind(text or "")))
            self._seen["statements"] = max(self._seen.get("statements", 0), end)

    def clear(self) -> None:
        connection = self.orbit.db.connect()
        try:
            cursor = connection.cursor()
            for table in ("transactions", "statements"):
                cursor.execute(f"TRUNCATE TABLE performance_schema.events_{table}_history_long")
        finally:
            connection.close()
        self._last_end.clear()
        self._seen.clear()

    def stop(self) -> None:
        self._stop.set()

    def marked(self) -> list[Transaction]:
        """Every transaction copied, with what its statements mark and the
        statements themselves, by start; a transaction whose first statement
        is the counter row's locking read starts with it."""
        for each in self.transactions.values():
            each.statements.clear()
        for (thread, event), (nesting, start, end, kind) in sorted(self.statements.items()):
            counter = kind == COUNTER_ROW
            if nesting is None and not counter:
                continue  # outside any transaction
            found = self.transactions.get((thread, nesting if nesting is not None else event + 1))
            if found is None:
                continue
            found.statements.append((start, end, kind))
            if kind == SETTLES:
                found.settles = True
            elif kind == ENDS_ATTEMPTS:
                found.ends_attempts = True
            elif counter and (found.counter_locked is None or start < found.counter_locked[0]):
                found.counter_locked = (start, end)
                found.start = min(found.start, start)
        return sorted(self.transactions.values(), key=lambda t: t.start)

    def commits(self) -> list[float]:
        """The wall-clock moments (epoch s) the settling transactions committed, ascending."""
        offset = statistics.median(self.offsets)
        return sorted(offset + t.end / 1e12 for t in self.marked() if t.settles)


@contextmanager
def polling(orbit: PrivateOrbit) -> Iterator[HistoryPoller]:
    poller = HistoryPoller(orbit)
    poller.clear()
    thread = threading.Thread(target=poller.run, name="performance-schema-poller", daemon=True)
    thread.start()
    try:
        yield poller
    finally:
        poller.stop()
        thread.join(timeout=30)


# ---------------------------------------------------------------- loading and running


class Loader:
    def __init__(self, orbit: PrivateOrbit) -> None:
        self.client = httpx.Client(base_url=orbit.url, headers=orbit.headers, timeout=120)

    def queue(self, name: str) -> str:
        created = self.client.post(
            "/v1/queues",
            json={"name": name, "max_concurrency": 10_000, "rate_per_second": 100_000},
            headers={"Idempotency-Key": uuid.uuid4().hex},
        )
        assert created.status_code == 201, created.text
        queue_id: str = created.json()["data"]["queue"]["id"]
        return queue_id

    def submit(
        self, queue_id: str, depends: list[list[str] | None], refs: Sequence[str | None] | None = None
    ) -> list[str]:
        """One task per entry of `depends` (its depends_on, ids or ref:NAME), `refs`
        naming them within the batch; answers their ids."""
        entries = []
        for n, wanted in enumerate(depends):
            task: dict[str, Any] = {
                "queue_id": queue_id,
                "handler": "dep",
                "handler_version": "v1",
                "payload_version": "v1",
                "payload": {},
            }
            if wanted:
                task["depends_on"] = wanted
            entry: dict[str, Any] = {"idempotency_key": uuid.uuid4().hex, "task": task}
            if refs and refs[n]:
                entry["ref"] = refs[n]
            entries.append(entry)
        answer = self.client.post("/v1/tasks:batch", json={"tasks": entries})
        assert answer.status_code == 200, answer.text[:2000]
        results = answer.json()["data"]["results"]
        refused = [item for item in results if item.get("status") != 201]
        assert not refused, refused[:3]
        return [item["task"]["id"] for item in results]

    def chain(self, queue_id: str, links: int) -> None:
        previous: str | None = None
        for first in range(0, links, BATCH):
            count = min(BATCH, links - first)
            refs = [f"l{n}" for n in range(count)]
            depends = [[previous] if previous else None] + [[f"ref:l{n - 1}"] for n in range(1, count)]
            previous = self.submit(queue_id, depends, refs)[-1]

    def fan_out(self, queue_id: str, dependents: int) -> None:
        (root,) = self.submit(queue_id, [None])
        for first in range(0, dependents, BATCH):
            self.submit(queue_id, [[root]] * min(BATCH, dependents - first))

    def fan_in(self, queue_id: str, children: int, joins: int) -> None:
        for _ in range(joins):
            ids: list[str] = []
            for first in range(0, children, BATCH):
                ids += self.submit(queue_id, [None] * min(BATCH, children - first))
            self.submit(queue_id, [ids])


def drain(orbit: PrivateOrbit, queue_id: str, args: argparse.Namespace, work: Path, deadline_s: float) -> float:
    """Runs `args.workers` SDK workers on the queue until every task is final; seconds taken."""
    worker_file = work / "worker.py"
    worker_file.write_text(WORKER_SOURCE)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'sdk'}:{ROOT}"}
    python = str(ROOT / ".venv" / "bin" / "python")
    workers = []
    began = time.monotonic()
    try:
        for n in range(args.workers):
            log = open(work / f"worker-{queue_id[:8]}-{n}.log", "w")  # noqa: SIM115 - the child's
            process = subprocess.Popen(
                [python, str(worker_file), orbit.url, orbit.token, queue_id, str(args.capacity)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            workers.append(process)
            assert process.stdout is not None
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError(f"worker did not start; see {log.name}")
        while True:
            left = orbit.query(
                "SELECT COUNT(*) FROM orbit_task WHERE queue_id = %s"
                " AND state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED')",
                (queue_id,),
            )[0][0]
            if not left:
                return time.monotonic() - began
            if time.monotonic() - began > deadline_s:
                raise RuntimeError(f"{left} tasks of queue {queue_id} not finished after {deadline_s:.0f} s")
            time.sleep(0.2)
    finally:
        for process in workers:
            process.terminate()
        for process in workers:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# ---------------------------------------------------------------- figures


def readiness(orbit: PrivateOrbit, queue_id: str, commits: list[float]) -> dict[str, list[float]]:
    """Seconds from each dependent's freeing ending to its WAITING event, to the
    commit of the settling transaction that wrote it (the first of `commits`
    at or after the event: the settling transactions hold the counter row
    from before their writes to their commits, one at a time), to its lease
    and to its Start."""
    finished: dict[str, datetime] = {}
    depends: dict[str, list[str]] = {}
    for task_id, finished_at, depends_on in orbit.query(
        "SELECT id, finished_at, depends_on FROM orbit_task WHERE queue_id = %s", (queue_id,)
    ):
        finished[task_id] = finished_at
        if depends_on:
            depends[task_id] = json.loads(depends_on)
    ready = dict(
        orbit.query(
            "SELECT e.subject_id, MIN(e.created_at) FROM orbit_event e JOIN orbit_task t ON t.id = e.subject_id"
            " WHERE t.queue_id = %s AND e.type = 'task.state_changed'"
            " AND JSON_VALUE(e.data, '$.state') = 'WAITING' AND JSON_VALUE(e.data, '$.previous') = 'BLOCKED'"
            " GROUP BY e.subject_id",
            (queue_id,),
        )
    )
    attempts = {
        task_id: (leased, started)
        for task_id, leased, started in orbit.query(
            "SELECT task_id, MIN(leased_at), MIN(started_at) FROM orbit_attempt WHERE queue_id = %s GROUP BY task_id",
            (queue_id,),
        )
    }
    figures: dict[str, list[float]] = {"ready": [], "visible": [], "leased": [], "started": []}
    missing = 0
    for task_id, parents in depends.items():
        freed = max(finished[parent] for parent in parents)
        if task_id not in ready or task_id not in attempts:
            missing += 1
            continue
        leased, started = attempts[task_id]
        figures["ready"].append((ready[task_id] - freed).total_seconds())
        at = bisect_left(commits, ready[task_id].replace(tzinfo=UTC).timestamp())
        if at < len(commits):
            figures["visible"].append(commits[at] - freed.replace(tzinfo=UTC).timestamp())
        figures["leased"].append((leased - freed).total_seconds())
        figures["started"].append((started - freed).total_seconds())
    if missing:
        raise RuntimeError(f"{missing} dependents of queue {queue_id} have no WAITING event or no attempt")
    return figures


def spread(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    return {
        "p50": round(percentile(values, 50) * scale, 2),
        "p99": round(percentile(values, 99) * scale, 2),
        "max": round(max(values) * scale, 2),
    }


def ms(values: list[float], q: float | None = None) -> float | None:
    """The longest (or the q-th percentile) of `values`, rounded; None for none."""
    if not values:
        return None
    return round(max(values) if q is None else percentile(values, q), 2)


def transaction_figures(marked: list[Transaction]) -> dict[str, Any]:
    """The settling transactions (endings that settle inline, follow-up chunks)
    and the others that overlap their span."""
    settling = [t for t in marked if t.settles]
    if not settling:
        return {"settling": 0}
    span = (settling[0].start, max(t.end for t in settling))
    endings = [t for t in settling if t.ends_attempts]
    follow_ups = [t for t in settling if not t.ends_attempts]
    others = [t for t in marked if not t.settles and t.end > span[0] and t.start < span[1]]
    held = [t.counter_held_ms for t in settling if t.counter_held_ms is not None]
    waits = [t.counter_wait_ms for t in settling if t.counter_wait_ms is not None]
    return {
        "settling": len(settling),
        "span_ms": round((span[1] - span[0]) / 1e9, 2),
        "longest_ms": ms([t.ms for t in settling]),
        "endings": len(endings),
        "endings_p99_ms": ms([t.ms for t in endings], 99),
        "endings_longest_ms": ms([t.ms for t in endings]),
        "follow_ups": len(follow_ups),
        "follow_ups_p50_ms": ms([t.ms for t in follow_ups], 50),
        "follow_ups_p99_ms": ms([t.ms for t in follow_ups], 99),
        "follow_ups_longest_ms": ms([t.ms for t in follow_ups]),
        "counter_held_p99_ms": ms(held, 99),
        "counter_held_longest_ms": ms(held),
        "counter_wait_longest_ms": ms(waits),
        "without_counter_lock": len(settling) - len(held),
        "rolled_back": sum(t.state != "COMMITTED" for t in settling),
        "others": len(others),
        "others_p99_ms": ms([t.ms for t in others], 99),
        "others_longest_ms": ms([t.ms for t in others]),
        "profile_endings": profile(endings),
        "profile_follow_ups": profile(follow_ups),
    }


def statement_kind(text: str) -> str:
    """A statement's verb and table, e.g. `UPDATE orbit_task` (of a multi-statement
    event's text, only its own statement)."""
    own = text.split(";", 1)[0].strip()
    verb = next((v for v in ("SELECT", "UPDATE", "INSERT", "DELETE", "SET", "COMMIT") if own.upper().startswith(v)), "")
    table = re.search(r"FROM `?(orbit_[a-z_]+)", own) or re.search(r"(orbit_[a-z_]+)", own)
    return f"{verb or own[:20]} {table.group(1) if table else ''}".strip()


def profile(transactions: list[Transaction]) -> dict[str, Any]:
    """Where the transactions' time goes: each statement kind's total ms and
    count, and the time between statements (the server's own work between
    round trips, and the trips), per transaction on average."""
    if not transactions:
        return {}
    kinds: dict[str, list[float]] = {}
    inside = 0.0
    for t in transactions:
        for start, end, kind in t.statements:
            kinds.setdefault(kind, []).append((end - start) / 1e9)
            inside += (end - start) / 1e9
    total = sum(t.ms for t in transactions)
    n = len(transactions)
    return {
        "transactions": n,
        "ms_each": round(total / n, 2),
        "between_statements_ms_each": round((total - inside) / n, 2),
        "statements": {
            kind: {"count_each": round(len(times) / n, 1), "ms_each": round(sum(times) / n, 2)}
            for kind, times in sorted(kinds.items(), key=lambda item: -sum(item[1]))
        },
    }


def fmt(figure: dict[str, float]) -> str:
    return f"{figure['p50']:,.1f} / {figure['p99']:,.1f} / {figure['max']:,.1f}"


def pair(first: float | None, second: float | None) -> str:
    return "–" if first is None else f"{first:,.1f} / {second:,.1f}"


def yes(held: bool) -> str:
    return "yes" if held else "NO"


def print_tables(summary: dict[str, Any]) -> None:
    print()
    print(
        "| shape | dependents | ready (event) p50 / p99 / max ms | committed p50 / p99 / max ms "
        "| leased p50 / p99 / max ms | started p50 / p99 / max ms | drain s | within 1 s (event, commit) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, phase in summary["phases"].items():
        print(
            f"| {name} | {phase['dependents']:,} | {fmt(phase['ready_ms'])} | {fmt(phase['visible_ms'])} "
            f"| {fmt(phase['leased_ms'])} | {fmt(phase['started_ms'])} | {phase['drain_s']:.1f} "
            f"| {yes(phase['ready_within_1s'])}, {yes(phase['visible_within_1s'])} |"
        )
    print()
    print(
        "| shape | settling transactions (endings + follow-ups) | their span ms | endings p99 / longest ms "
        "| follow-ups p50 / p99 / longest ms | counter row held p99 / longest ms | waited for it, longest ms "
        "| others in the span: n, p99 / longest ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, phase in summary["phases"].items():
        t = phase["transactions"]
        if not t["settling"]:
            print(f"| {name} | 0 | | | | | | |")
            continue
        follow = (
            "–"
            if not t["follow_ups"]
            else f"{t['follow_ups_p50_ms']:,.1f} / {t['follow_ups_p99_ms']:,.1f} / {t['follow_ups_longest_ms']:,.1f}"
        )
        print(
            f"| {name} | {t['settling']:,} ({t['endings']:,} + {t['follow_ups']:,}) | {t['span_ms']:,.1f} "
            f"| {pair(t['endings_p99_ms'], t['endings_longest_ms'])} | {follow} "
            f"| {pair(t['counter_held_p99_ms'], t['counter_held_longest_ms'])} | {t['counter_wait_longest_ms']} "
            f"| {t['others']:,}, {pair(t['others_p99_ms'], t['others_longest_ms'])} |"
        )
    for name, phase in summary["phases"].items():
        for part, label in (("profile_follow_ups", "follow-up"), ("profile_endings", "settling ending")):
            shown = phase["transactions"].get(part)
            if not shown:
                continue
            print()
            print(
                f"{name}: where a {label} transaction's time goes, average of {shown['transactions']} "
                f"({shown['ms_each']:,.1f} ms each)"
            )
            print()
            print("| statement | count | ms |")
            print("| --- | --- | --- |")
            for kind, figure in list(shown["statements"].items())[:8]:
                print(f"| {kind} | {figure['count_each']:g} | {figure['ms_each']:,.2f} |")
            print(
                f"| between statements (the server's work, the trips) | | {shown['between_statements_ms_each']:,.2f} |"
            )
    print()
    phases = summary["phases"].values()
    print(
        f"every dependent ready within {READY_WITHIN_S:g} s of the ending that freed it: "
        f"{yes(all(p['ready_within_1s'] for p in phases))} by its WAITING event, "
        f"{yes(all(p['visible_within_1s'] for p in phases))} by its transaction's commit"
    )
    unmatched = sum(p["visible_unmatched"] for p in phases)
    if unmatched:
        print(f"{unmatched} WAITING events matched no settling transaction's commit (left out of 'committed')")
    print(f"load average: {summary['load_average_at_start']} at start, {summary['load_average_at_end']} at end")
    if summary["history_wrapped"]:
        print("performance_schema's history wrapped between two polls: some transactions are missing")


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = {**SIZES["quick" if args.quick else "full"]}
    for name in sizes:
        if getattr(args, name) is not None:
            sizes[name] = getattr(args, name)
    work = Path(tempfile.mkdtemp(prefix="orbit-dependencies-"))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    summary: dict[str, Any] = {
        "commit": commit,
        "sizes": sizes,
        "workers": args.workers,
        "capacity": args.capacity,
        "cores": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "phases": {},
        "history_wrapped": False,
    }
    print(f"work dir {work}, sizes {sizes}, load average {summary['load_average_at_start']}", file=sys.stderr)
    with private_orbit(ROOT, "deps", work, mariadb_args=MARIADB_ARGS) as orbit:
        loader = Loader(orbit)
        shapes = {
            "chain": (lambda q: loader.chain(q, sizes["chain"]), f"chain of {sizes['chain']:,}"),
            "fan-out": (lambda q: loader.fan_out(q, sizes["fan_out"]), f"fan-out of {sizes['fan_out']:,}"),
            "fan-in": (
                lambda q: loader.fan_in(q, sizes["fan_in"], sizes["joins"]),
                f"fan-in of {sizes['fan_in']:,} ×{sizes['joins']}",
            ),
        }
        for name, (load, label) in shapes.items():
            queue_id = loader.queue(name)
            began = time.monotonic()
            load(queue_id)
            print(f"{label}: loaded in {time.monotonic() - began:.1f} s", file=sys.stderr)
            with polling(orbit) as poller:
                seconds = drain(orbit, queue_id, args, work, args.deadline)
            summary["history_wrapped"] |= poller.wrapped
            figures = readiness(orbit, queue_id, poller.commits())
            left = orbit.query("SELECT COUNT(*) FROM orbit_dependency_settlement")[0][0]
            summary["phases"][label] = {
                "dependents": len(figures["ready"]),
                "drain_s": round(seconds, 2),
                "ready_ms": spread(figures["ready"]),
                "visible_ms": spread(figures["visible"]),
                "visible_unmatched": len(figures["ready"]) - len(figures["visible"]),
                "leased_ms": spread(figures["leased"]),
                "started_ms": spread(figures["started"]),
                "ready_within_1s": max(figures["ready"]) <= READY_WITHIN_S,
                "visible_within_1s": max(figures["visible"]) <= READY_WITHIN_S,
                "settlements_left": left,
                "transactions": transaction_figures(poller.marked()),
            }
            print(f"{label}: drained in {seconds:.1f} s", file=sys.stderr)
    summary["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke sizes: a chain of 20, 600 and 2 × 50")
    parser.add_argument("--chain", type=int, default=None, help="links of the chain (full: 1,000)")
    parser.add_argument("--fan-out", type=int, default=None, help="dependents of the one root (full: 10,000)")
    parser.add_argument("--fan-in", type=int, default=None, help="children of each join, at most 1,000 (full: 1,000)")
    parser.add_argument("--joins", type=int, default=None, help="joins, each with children of its own (full: 3)")
    parser.add_argument("--workers", type=int, default=2, help="SDK worker processes")
    parser.add_argument("--capacity", type=int, default=32, help="each worker's capacity")
    parser.add_argument("--deadline", type=float, default=600, help="seconds each shape may take to drain")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures there")
    args = parser.parse_args()
    summary = run(args)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    print_tables(summary)


if __name__ == "__main__":
    main()

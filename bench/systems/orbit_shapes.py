"""W0: the physical ceiling. Orbit's transaction shapes as raw SQL on MariaDB,
without Django, one connection, the same statements and row locks the server
issues (tasks/actions), in two forms.

Single verbs, one transaction each: submit, lease (batch of 16), start,
result. Prints commits_per_s_<verb>, transactions_per_task and
ceiling_tasks_per_s = tasks / (time to push them through all four shapes).

Grouped, as the server commits them now (tasks.actions.rounds), with a group size K
(--group, default 16): rounds, each the submits, results, starts and leases
of one application in one transaction (tasks.actions.rounds.run_round): the
unlocked first reads in one round trip (the submits' idempotency records, the
peeks of results and starts, the configuration), then the submits' records (each with its final
receipt) and task rows before any lock (batch.write_submissions), the counter
rows locked once and, the round having no concurrency key, the results' and
starts' tasks and attempts after them (all in one round trip:
orbit.db.rows.locked_ahead), admission of K submits, results of K running
attempts (endings.apply_reports with a WriteBook), starts of K leased attempts
(dispatch.apply_starts), a lease of K (dispatch.lease), the round's 4K events in one insert,
and each counter row written once (orbit.db.rows.holding); the writes go with the
next statement, in one multi-statement query (orbit.db.rows.writes_sent_together),
and the last ones with the COMMIT (orbit.db.rows.atomic_sent_together).
Prints commits_per_s_round (rounds that carry K submits, K results, K starts
and K leases), transactions_per_task_grouped = 1/K and
ceiling_tasks_per_s_grouped = tasks / (time to push them through pipelined
rounds: each round submits K, finishes the previous round's started tasks,
starts its leases and leases K more; filling and draining the pipeline count).

Each of the two parts is sized to take about --seconds. Run with Orbit's
interpreter (it migrates a fresh database first):

    .venv/bin/python -m bench.systems.orbit_shapes --seconds 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import MySQLdb
from MySQLdb.constants import CLIENT

ROOT = Path(__file__).resolve().parent.parent.parent
LEASE_BATCH = 16
GROUP = 16

LOCK_APPLICATION_STATE = "SELECT * FROM orbit_application_state WHERE application_id=%s FOR UPDATE"
LOCK_QUEUE_STATES = "SELECT * FROM orbit_queue_state WHERE queue_id IN (%s) ORDER BY queue_id FOR UPDATE"
IDEMPOTENCY_INSERT = (
    "INSERT INTO orbit_idempotency_record (namespace_id,`key`,operation,digest,response_status,"
    "response_data,request_id,created_at) VALUES "
)
IDEMPOTENCY_ROW = "(%s,%s,'task.submit',%s,0,'{}',%s,NOW(6))"
RECEIPT_ROW = "(%s,%s,'task.submit',%s,201,%s,%s,NOW(6))"
TASK_INSERT = (
    "INSERT INTO orbit_task (id,namespace_id,application_id,queue_id,handler,handler_version,"
    "payload_version,payload,business_key,concurrency_key,key_ready,priority,state,attempts,max_attempts,"
    "epoch,available_at,retry_initial_seconds,retry_multiplier,retry_max_seconds,lease_seconds,"
    "cancel_requested,created_at,updated_at) VALUES "
)
TASK_ROW = "(%s,%s,%s,%s,'noop','v1','v1','{}','','',1,5,'WAITING',0,3,0,NOW(6),1,2,300,30,0,NOW(6),NOW(6))"
ATTEMPT_INSERT = (
    "INSERT INTO orbit_attempt (id,task_id,namespace_id,application_id,queue_id,state,epoch,"
    "concurrency_key,worker_id,session_id,leased_at,lease_expires_at,outcome,retryable) VALUES "
)
ATTEMPT_ROW = "(%s,%s,%s,%s,%s,'LEASED',%s,'','w0',%s,NOW(6),NOW(6)+INTERVAL 30 SECOND,'',0)"
EVENT_SEQUENCE = (  # orbit.audit._insert_events: the namespace's cursor row, advanced under its lock
    "INSERT INTO orbit_event_sequence (namespace_id,last_seq) VALUES (%s,%s) "
    "ON DUPLICATE KEY UPDATE last_seq=(@orbit_event_seq:=last_seq)+%s"
)


def event_statements(ns: str, subjects: list[str]) -> list[tuple[str, list]]:
    """A transaction's events, as orbit.audit writes them: the cursor row, then
    one INSERT numbering its rows from the row's previous value."""
    n = len(subjects)
    rows = ",".join(f"(%s,@orbit_event_seq+{k},'task.state_changed',%s,'{{}}',NOW(6))" for k in range(1, n + 1))
    return [
        ("SET @orbit_event_seq=0", []),
        (EVENT_SEQUENCE, [ns, n, n]),
        (
            "INSERT INTO orbit_event (namespace_id,seq,type,subject_id,data,created_at) VALUES " + rows,
            [value for subject in subjects for value in (ns, subject)],
        ),
    ]


def write_events(c, ns: str, subjects: list[str]) -> None:
    for sql, params in event_statements(ns, subjects):
        c.execute(sql, params)


CANDIDATES = (
    "FROM orbit_task WHERE queue_id=%s AND state='WAITING' AND available_at<=NOW(6) "
    "AND key_ready=1 AND (deadline_at IS NULL OR deadline_at>NOW(6)) AND concurrency_key='' "
    "ORDER BY priority DESC, available_at, id LIMIT %s FOR UPDATE SKIP LOCKED"
)


def hexid() -> str:
    return uuid.uuid4().hex


def marks(n: int) -> str:
    """Placeholders of an IN list of n values."""
    return ",".join(["%s"] * n)


def insert_rows(c, head: str, row: str, rows: list[tuple]) -> None:
    """One multi-row INSERT, as Django's bulk_create issues. (MySQLdb's
    executemany sends one statement per row when a row holds literals.)"""
    c.execute(head + ",".join([row] * len(rows)), [value for values in rows for value in values])


def setup(database: str) -> tuple[MySQLdb.Connection, dict]:
    admin = MySQLdb.connect(host="127.0.0.1", user="root", passwd="")
    admin.cursor().execute(f"DROP DATABASE IF EXISTS `{database}`")
    admin.cursor().execute(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
    admin.close()
    env = {**os.environ, "ORBIT_MYSQL_DSN": f"mysql://root:@127.0.0.1:3306/{database}"}
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    db = MySQLdb.connect(
        host="127.0.0.1", user="root", passwd="", db=database, charset="utf8mb4", client_flag=CLIENT.MULTI_STATEMENTS
    )
    db.autocommit(True)
    c = db.cursor()
    c.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    ids = {"app": hexid(), "ns": hexid(), "queue": hexid()}
    c.execute(
        "INSERT INTO orbit_application (id,name,max_active_attempts,max_unfinished_tasks,revision,created_at,"
        "updated_at) VALUES (%s,'w0',100000,10000000,1,NOW(6),NOW(6))",
        (ids["app"],),
    )
    c.execute("INSERT INTO orbit_application_state VALUES (%s,0,0)", (ids["app"],))
    c.execute(
        "INSERT INTO orbit_queue (id,namespace_id,application_id,name,paused,max_concurrency,rate_per_second,"
        "max_unfinished_tasks,revision,created_at,updated_at) VALUES (%s,%s,%s,'w0',0,100000,1000000,1000000,1,"
        "NOW(6),NOW(6))",
        (ids["queue"], ids["ns"], ids["app"]),
    )
    c.execute(
        "INSERT INTO orbit_queue_state (queue_id,application_id,unfinished_tasks,active_permits,reserved_starts,"
        "window_count,accepting) VALUES (%s,%s,0,0,0,0,1)",
        (ids["queue"], ids["app"]),
    )
    return db, ids


def submit(c, ids: dict, n: int) -> None:
    """tasks.actions.submit.admit_tasks via the idempotency runner: configuration
    and the task row before the locks, counters and the event under them."""
    key = f"w0-{n}"
    c.execute("SELECT id FROM orbit_idempotency_record WHERE namespace_id=%s AND `key`=%s", (ids["ns"], key))
    c.fetchall()
    c.execute("BEGIN")
    c.execute(IDEMPOTENCY_INSERT + IDEMPOTENCY_ROW, (ids["ns"], key, "d" * 64, hexid()))
    record_id = c.lastrowid
    c.execute(
        "SELECT id,max_unfinished_tasks FROM orbit_queue WHERE id IN (%s) AND namespace_id=%s",
        (ids["queue"], ids["ns"]),
    )
    c.execute("SELECT max_unfinished_tasks FROM orbit_application WHERE id=%s", (ids["app"],))
    task_id = hexid()
    c.execute(TASK_INSERT + TASK_ROW, (task_id, ids["ns"], ids["app"], ids["queue"]))
    c.execute(LOCK_APPLICATION_STATE, (ids["app"],))
    c.execute(LOCK_QUEUE_STATES, (ids["queue"],))
    c.execute(
        "UPDATE orbit_application_state SET unfinished_tasks=unfinished_tasks+1 WHERE application_id=%s", (ids["app"],)
    )
    c.execute("UPDATE orbit_queue_state SET unfinished_tasks=unfinished_tasks+1 WHERE queue_id=%s", (ids["queue"],))
    write_events(c, ids["ns"], [task_id])
    c.execute("UPDATE orbit_idempotency_record SET response_status=201, response_data='{}' WHERE id=%s", (record_id,))
    c.execute("COMMIT")


def lease(c, ids: dict) -> list[tuple[str, str, int]]:
    c.execute("BEGIN")
    c.execute(LOCK_APPLICATION_STATE, (ids["app"],))
    c.execute("SELECT max_active_attempts FROM orbit_application WHERE id=%s", (ids["app"],))
    c.execute(LOCK_QUEUE_STATES, (ids["queue"],))
    c.execute("SELECT * FROM orbit_queue WHERE id IN (%s) AND namespace_id=%s", (ids["queue"], ids["ns"]))
    c.execute("SELECT id, epoch " + CANDIDATES, (ids["queue"], LEASE_BATCH))
    tasks = c.fetchall()
    if not tasks:
        c.execute("COMMIT")
        return []
    leased = [(task_id, hexid(), epoch + 1) for task_id, epoch in tasks]
    c.executemany(
        ATTEMPT_INSERT + ATTEMPT_ROW,
        [(a, t, ids["ns"], ids["app"], ids["queue"], e, "s" * 32) for t, a, e in leased],
    )
    cases = " ".join(f"WHEN '{t}' THEN {e}" for t, _, e in leased)
    c.execute(
        f"UPDATE orbit_task SET state='LEASED', epoch=CASE id {cases} END, updated_at=NOW(6) "
        f"WHERE id IN ({','.join(repr(t) for t, _, _ in leased)})"
    )
    c.execute(
        "UPDATE orbit_application_state SET active_attempts=active_attempts+%s WHERE application_id=%s",
        (len(leased), ids["app"]),
    )
    c.execute(
        "UPDATE orbit_queue_state SET active_permits=active_permits+%s, reserved_starts=reserved_starts+%s "
        "WHERE queue_id=%s",
        (len(leased), len(leased), ids["queue"]),
    )
    write_events(c, ids["ns"], [t for t, _, _ in leased])
    c.execute("COMMIT")
    return leased


def start(c, ids: dict, task_id: str, attempt_id: str) -> None:
    """tasks.actions.dispatch.approve_start: queue_state → task → attempt."""
    c.execute("SELECT * FROM orbit_attempt WHERE id=%s AND namespace_id=%s", (attempt_id, ids["ns"]))
    c.execute("BEGIN")
    c.execute(LOCK_QUEUE_STATES, (ids["queue"],))
    c.execute("SELECT * FROM orbit_task WHERE id=%s FOR UPDATE", (task_id,))
    c.execute("SELECT * FROM orbit_attempt WHERE id=%s FOR UPDATE", (attempt_id,))
    c.execute("SELECT paused, retired_at, rate_per_second FROM orbit_queue WHERE id=%s", (ids["queue"],))
    c.execute(
        "UPDATE orbit_queue_state SET window_started_at=NOW(6), window_count=window_count+1, "
        "reserved_starts=reserved_starts-1 WHERE queue_id=%s",
        (ids["queue"],),
    )
    c.execute("UPDATE orbit_task SET attempts=attempts+1, state='RUNNING', updated_at=NOW(6) WHERE id=%s", (task_id,))
    c.execute("UPDATE orbit_attempt SET state='RUNNING', number=1, started_at=NOW(6) WHERE id=%s", (attempt_id,))
    write_events(c, ids["ns"], [task_id])
    c.execute("COMMIT")


def result(c, ids: dict, task_id: str, attempt_id: str) -> None:
    """tasks.actions.endings.record_result: one peek, the lock chain, settle()
    with one UPDATE per counter row."""
    c.execute(
        "SELECT task_id, application_id, queue_id, namespace_id, concurrency_key, worker_id, epoch "
        "FROM orbit_attempt WHERE id=%s",
        (attempt_id,),
    )
    c.execute("BEGIN")
    c.execute(LOCK_APPLICATION_STATE, (ids["app"],))
    c.execute(LOCK_QUEUE_STATES, (ids["queue"],))
    c.execute("SELECT * FROM orbit_task WHERE id=%s FOR UPDATE", (task_id,))
    c.execute("SELECT * FROM orbit_attempt WHERE id=%s FOR UPDATE", (attempt_id,))
    c.execute(
        "UPDATE orbit_attempt SET state='SUCCEEDED', finished_at=NOW(6), outcome='SUCCEEDED' WHERE id=%s",
        (attempt_id,),
    )
    c.execute("UPDATE orbit_task SET state='SUCCEEDED', updated_at=NOW(6), finished_at=NOW(6) WHERE id=%s", (task_id,))
    write_events(c, ids["ns"], [task_id])
    c.execute(
        "UPDATE orbit_application_state SET active_attempts=active_attempts-1, unfinished_tasks=unfinished_tasks-1 "
        "WHERE application_id=%s",
        (ids["app"],),
    )
    c.execute(
        "UPDATE orbit_queue_state SET active_permits=active_permits-1, unfinished_tasks=unfinished_tasks-1 "
        "WHERE queue_id=%s",
        (ids["queue"],),
    )
    c.execute("COMMIT")


def insert_sql(head: str, row: str, rows: list[tuple]) -> tuple[str, list]:
    return head + ",".join([row] * len(rows)), [value for values in rows for value in values]


class Together:
    """orbit.db.rows.writes_sent_together: a round's writes wait and go in one
    multi-statement query with its next statement, or when it ends."""

    def __init__(self, c) -> None:
        self.c = c
        self.waiting: list[tuple[str, list]] = []

    def write(self, sql: str, params) -> None:
        self.waiting.append((sql, list(params)))

    def execute(self, sql: str, params) -> None:
        self.waiting.append((sql, list(params)))
        self.send()

    def send(self) -> None:
        if not self.waiting:
            return
        statements, self.waiting = self.waiting, []
        self.c.execute("; ".join(sql for sql, _ in statements), [p for _, params in statements for p in params])
        for _ in range(len(statements) - 1):
            self.c.nextset()


def dispatch_round(
    c,
    ids: dict,
    finishing: list[tuple[str, str]],
    starting: list[tuple[str, str]],
    want: int,
    numbers: range = range(0),
) -> list[tuple[str, str]]:
    """tasks.actions.rounds.run_round: submits of `numbers`, results of
    `finishing`, starts of `starting` (task id, attempt id) and a lease of up
    to `want`, in one transaction. Returns the leased (task id, attempt id) pairs."""
    ns, app, queue = ids["ns"], ids["app"], ids["queue"]
    keys = sorted(f"w0g-{n}" for n in numbers)
    # The round's first reads, unlocked, in one round trip (run_round's _FirstReads): the
    # submits' idempotency records (replays are answered before the transaction), the
    # attempts of its results and starts, the configuration of its application and queue.
    first = Together(c)
    if keys:
        first.write(
            f"SELECT * FROM orbit_idempotency_record WHERE namespace_id=%s AND `key` IN ({marks(len(keys))})",
            (ns, *keys),
        )
    peeked = sorted(a for _, a in (*finishing, *starting))
    if peeked:
        first.write(f"SELECT * FROM orbit_attempt WHERE id IN ({marks(len(peeked))}) ORDER BY id", peeked)
    first.write("SELECT * FROM orbit_application WHERE id IN (%s) ORDER BY id", (app,))
    first.write("SELECT * FROM orbit_queue WHERE id IN (%s) ORDER BY id", (queue,))
    first.send()
    c.execute("BEGIN")
    t = Together(c)  # orbit.db.rows.writes_sent_together
    events = []
    app_deltas = {"active_attempts": 0, "unfinished_tasks": 0}
    queue_deltas = {"active_permits": 0, "unfinished_tasks": 0, "reserved_starts": 0, "window_count": 0}
    if keys:
        # batch.write_submissions (the round's configuration): the records with their receipts (key order), the tasks.
        receipt = json.dumps({"deduplicated": False, "task": {"id": hexid(), "payload": {}, "state": "WAITING"}})
        t.write(*insert_sql(IDEMPOTENCY_INSERT, RECEIPT_ROW, [(ns, key, "d" * 64, receipt, hexid()) for key in keys]))
        task_ids = [hexid() for _ in keys]
        t.write(*insert_sql(TASK_INSERT, TASK_ROW, [(task, ns, app, queue) for task in task_ids]))
    # The counter rows, locked once, and with no concurrency key in the round the results'
    # and starts' tasks and attempts after them, all in one round trip
    # (orbit.db.rows.lock_by_pk_together, locked_ahead); every part's changes to the counter
    # rows are written at the end.
    t.write(LOCK_APPLICATION_STATE, (app,))
    t.write(LOCK_QUEUE_STATES, (queue,))
    chains = (*finishing, *starting)
    if chains:
        tasks, attempts = sorted(t for t, _ in chains), sorted(a for _, a in chains)
        t.write(f"SELECT * FROM orbit_task WHERE id IN ({marks(len(tasks))}) ORDER BY id FOR UPDATE", tasks)
        t.write(f"SELECT * FROM orbit_attempt WHERE id IN ({marks(len(attempts))}) ORDER BY id FOR UPDATE", attempts)
    t.send()
    if keys:  # batch.admit_submissions: counted under the locks
        app_deltas["unfinished_tasks"] += len(keys)
        queue_deltas["unfinished_tasks"] += len(keys)
        events += [(ns, task) for task in task_ids]
    if finishing:
        # endings.apply_reports: the attempt chains (locked ahead), then the WriteBook:
        # one UPDATE per table (equal values).
        tasks, attempts = sorted(t for t, _ in finishing), sorted(a for _, a in finishing)
        n = len(finishing)
        t.write(
            "UPDATE orbit_attempt SET finished_at=NOW(6), outcome='SUCCEEDED', output=NULL, state='SUCCEEDED' "
            f"WHERE id IN ({marks(n)})",
            attempts,
        )
        t.write(
            "UPDATE orbit_task SET finished_at=NOW(6), output=NULL, state='SUCCEEDED', updated_at=NOW(6) "
            f"WHERE id IN ({marks(n)})",
            tasks,
        )
        app_deltas["active_attempts"] -= n
        app_deltas["unfinished_tasks"] -= n
        queue_deltas["active_permits"] -= n
        queue_deltas["unfinished_tasks"] -= n
        events += [(ns, task) for task, _ in finishing]
    if starting:
        # dispatch.apply_starts: tasks and attempts locked ahead (queue_state held), one UPDATE each.
        tasks, attempts = sorted(t for t, _ in starting), sorted(a for _, a in starting)
        n = len(starting)
        queue_deltas["window_count"] += n
        queue_deltas["reserved_starts"] -= n
        t.write(
            f"UPDATE orbit_task SET state='RUNNING', attempts=attempts+1, updated_at=NOW(6) WHERE id IN ({marks(n)})",
            tasks,
        )
        t.write(
            "UPDATE orbit_attempt SET state='RUNNING', number=1, started_at=NOW(6), "
            f"lease_expires_at=NOW(6)+INTERVAL 30 SECOND WHERE id IN ({marks(n)})",
            attempts,
        )
        events += [(ns, task) for task, _ in starting]
    leased: list[tuple[str, str]] = []
    if want > 0:
        # dispatch.lease: one candidate scan, then one statement per table.
        t.execute("SELECT id, epoch, orbit_task.* " + CANDIDATES, (queue, want))
        candidates = [(row[0], row[1], hexid()) for row in c.fetchall()]
        if candidates:
            leased = [(task_id, attempt_id) for task_id, _, attempt_id in candidates]
            t.write(
                *insert_sql(
                    ATTEMPT_INSERT,
                    ATTEMPT_ROW,
                    [(a, task, ns, app, queue, epoch + 1, "s" * 32) for task, epoch, a in candidates],
                )
            )
            n = len(leased)
            t.write(
                f"UPDATE orbit_task SET state='LEASED', epoch=epoch+1, updated_at=NOW(6) WHERE id IN ({marks(n)})",
                [task for task, _ in leased],
            )
            app_deltas["active_attempts"] += n
            queue_deltas["active_permits"] += n
            queue_deltas["reserved_starts"] += n
            events += [(ns, task) for task, _ in leased]
    if events:  # orbit.audit.gathered_events: the round's events in one insert
        for sql, params in event_statements(ns, [subject for _, subject in events]):
            t.write(sql, params)
    # orbit.db.rows.holding: each changed counter row written once, with its final values.
    t.write(
        "UPDATE orbit_application_state SET active_attempts=active_attempts+%s, unfinished_tasks=unfinished_tasks+%s "
        "WHERE application_id=%s",
        (app_deltas["active_attempts"], app_deltas["unfinished_tasks"], app),
    )
    t.write(
        "UPDATE orbit_queue_state SET active_permits=active_permits+%s, unfinished_tasks=unfinished_tasks+%s, "
        "reserved_starts=reserved_starts+%s, window_count=window_count+%s, window_started_at=NOW(6) "
        "WHERE queue_id=%s",
        (
            queue_deltas["active_permits"],
            queue_deltas["unfinished_tasks"],
            queue_deltas["reserved_starts"],
            queue_deltas["window_count"],
            queue,
        ),
    )
    t.write("COMMIT", ())  # orbit.db.rows.atomic_sent_together: the last writes carry the COMMIT
    t.send()
    return leased


def push_grouped(c, ids: dict, first: int, tasks: int, group: int) -> dict:
    """Pushes `tasks` through pipelined rounds, K submits per round, until all
    finished. Returns the seconds and rounds, in all and in steady state."""
    leased: list[tuple[str, str]] = []
    started: list[tuple[str, str]] = []
    rounds = steady = finished = 0
    round_seconds = steady_seconds = 0.0
    low, end = first, first + tasks
    while True:
        numbers = range(low, min(low + group, end))
        low = numbers.stop
        began = time.perf_counter()
        new = dispatch_round(c, ids, started, leased, group, numbers)
        seconds = time.perf_counter() - began
        rounds += 1
        round_seconds += seconds
        if len(numbers) == len(started) == len(leased) == len(new) == group:
            steady += 1
            steady_seconds += seconds
        finished += len(started)
        started, leased = leased, new
        if not (started or leased or low < end):
            break
    assert finished == tasks, (finished, tasks)
    return {"rounds": (round_seconds, rounds), "steady": (steady_seconds, steady)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20, help="about this long for each part (single, grouped)")
    parser.add_argument("--group", type=int, default=GROUP, help="submits, results, starts and leases per round")
    parser.add_argument("--run", type=int, default=0)
    args = parser.parse_args()
    group = max(1, args.group)
    database = f"bench_orbit_w0_{args.run}"
    db, ids = setup(database)
    c = db.cursor()
    try:
        # Size the run so the four phases take about --seconds together.
        probe = time.perf_counter()
        for n in range(50):
            submit(c, ids, n)
        per_submit = (time.perf_counter() - probe) / 50
        tasks = max(200, int(args.seconds / (per_submit * 3.2)))
        timings = {}
        began = time.perf_counter()
        for n in range(50, 50 + tasks):
            submit(c, ids, n)
        timings["submit"] = (time.perf_counter() - began, tasks)
        leased: list[tuple[str, str, int]] = []
        began = time.perf_counter()
        lease_commits = 0
        while len(leased) < tasks + 50:
            batch = lease(c, ids)
            lease_commits += 1
            if not batch:
                break
            leased.extend(batch)
        timings["lease"] = (time.perf_counter() - began, lease_commits)
        began = time.perf_counter()
        for task_id, attempt_id, _ in leased:
            start(c, ids, task_id, attempt_id)
        timings["start"] = (time.perf_counter() - began, len(leased))
        began = time.perf_counter()
        for task_id, attempt_id, _ in leased:
            result(c, ids, task_id, attempt_id)
        timings["result"] = (time.perf_counter() - began, len(leased))
        total = sum(seconds for seconds, _ in timings.values())
        out = {f"commits_per_s_{shape}": round(count / seconds, 1) for shape, (seconds, count) in timings.items()}
        out.update(
            tasks=len(leased),
            transactions_per_task=round(1 + 1 / LEASE_BATCH + 1 + 1, 3),
            ceiling_tasks_per_s=round(len(leased) / total, 1),
            commits_per_s=round(sum(count for _, count in timings.values()) / total, 1),
        )

        # Grouped: a small pass through the whole pipeline sizes the measured one.
        probe_tasks = 8 * group
        probe = push_grouped(c, ids, 0, probe_tasks, group)
        per_task = probe["rounds"][0] / probe_tasks
        grouped_tasks = max(20 * group, int(args.seconds / per_task) // group * group)
        parts = push_grouped(c, ids, probe_tasks, grouped_tasks, group)
        (round_seconds, rounds), (steady_seconds, steady) = parts["rounds"], parts["steady"]
        if not steady:  # too few tasks for a full round: every round counts
            steady_seconds, steady = round_seconds, rounds
        out.update(
            group=group,
            tasks_grouped=grouped_tasks,
            commits_per_s_round=round(steady / steady_seconds, 1),
            transactions_per_task_grouped=round(1 / group, 3),
            ceiling_tasks_per_s_grouped=round(grouped_tasks / round_seconds, 1),
        )
        print(json.dumps(out))
    finally:
        db.close()
        admin = MySQLdb.connect(host="127.0.0.1", user="root", passwd="")
        admin.cursor().execute(f"DROP DATABASE IF EXISTS `{database}`")
        admin.close()


if __name__ == "__main__":
    main()

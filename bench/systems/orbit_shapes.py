"""W0: the physical ceiling. Orbit's transaction shapes as raw SQL on MariaDB,
without Django, one connection, the same statements and row locks the verbs
issue (tasks/actions): submit, lease (batch of 16), start, result.

Prints one JSON line: commits_per_s_<shape>, transactions_per_task and
ceiling_tasks_per_s = tasks / (time to push them through all four shapes).
Run with Orbit's interpreter (it migrates a fresh database first):

    .venv/bin/python bench/systems/orbit_shapes.py --seconds 20
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

ROOT = Path(__file__).resolve().parent.parent.parent
LEASE_BATCH = 16


def hexid() -> str:
    return uuid.uuid4().hex


def setup(database: str) -> tuple[MySQLdb.Connection, dict]:
    admin = MySQLdb.connect(host="127.0.0.1", user="root", passwd="")
    admin.cursor().execute(f"DROP DATABASE IF EXISTS `{database}`")
    admin.cursor().execute(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
    admin.close()
    env = {**os.environ, "ORBIT_MYSQL_DSN": f"mysql://root:@127.0.0.1:3306/{database}"}
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    db = MySQLdb.connect(host="127.0.0.1", user="root", passwd="", db=database, charset="utf8mb4")
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
    c.execute(
        "INSERT INTO orbit_idempotency_record (namespace_id,`key`,operation,digest,response_status,"
        "response_data,request_id,created_at) VALUES (%s,%s,'task.submit',%s,0,'{}',%s,NOW(6))",
        (ids["ns"], key, "d" * 64, hexid()),
    )
    record_id = c.lastrowid
    c.execute(
        "SELECT id,max_unfinished_tasks FROM orbit_queue WHERE id IN (%s) AND namespace_id=%s",
        (ids["queue"], ids["ns"]),
    )
    c.execute("SELECT max_unfinished_tasks FROM orbit_application WHERE id=%s", (ids["app"],))
    task_id = hexid()
    c.execute(
        "INSERT INTO orbit_task (id,namespace_id,application_id,queue_id,handler,handler_version,"
        "payload_version,payload,business_key,concurrency_key,key_ready,priority,state,attempts,max_attempts,"
        "epoch,available_at,retry_initial_seconds,retry_multiplier,retry_max_seconds,lease_seconds,"
        "cancel_requested,created_at,updated_at) VALUES (%s,%s,%s,%s,'noop','v1','v1','{}','','',1,5,"
        "'WAITING',0,3,0,NOW(6),1,2,300,30,0,NOW(6),NOW(6))",
        (task_id, ids["ns"], ids["app"], ids["queue"]),
    )
    c.execute("SELECT * FROM orbit_application_state WHERE application_id=%s FOR UPDATE", (ids["app"],))
    c.execute("SELECT * FROM orbit_queue_state WHERE queue_id IN (%s) ORDER BY queue_id FOR UPDATE", (ids["queue"],))
    c.execute(
        "UPDATE orbit_application_state SET unfinished_tasks=unfinished_tasks+1 WHERE application_id=%s", (ids["app"],)
    )
    c.execute("UPDATE orbit_queue_state SET unfinished_tasks=unfinished_tasks+1 WHERE queue_id=%s", (ids["queue"],))
    c.execute(
        "INSERT INTO orbit_event (namespace_id,type,subject_id,data,created_at) VALUES "
        "(%s,'task.state_changed',%s,'{}',NOW(6))",
        (ids["ns"], task_id),
    )
    c.execute("UPDATE orbit_idempotency_record SET response_status=201, response_data='{}' WHERE id=%s", (record_id,))
    c.execute("COMMIT")


def lease(c, ids: dict) -> list[tuple[str, str, int]]:
    c.execute("BEGIN")
    c.execute("SELECT * FROM orbit_application_state WHERE application_id=%s FOR UPDATE", (ids["app"],))
    c.execute("SELECT max_active_attempts FROM orbit_application WHERE id=%s", (ids["app"],))
    c.execute("SELECT * FROM orbit_queue_state WHERE queue_id IN (%s) ORDER BY queue_id FOR UPDATE", (ids["queue"],))
    c.execute("SELECT * FROM orbit_queue WHERE id IN (%s) AND namespace_id=%s", (ids["queue"], ids["ns"]))
    c.execute(
        "SELECT id, epoch FROM orbit_task WHERE queue_id=%s AND state='WAITING' AND available_at<=NOW(6) "
        "AND key_ready=1 AND (deadline_at IS NULL OR deadline_at>NOW(6)) AND concurrency_key='' "
        "ORDER BY priority DESC, available_at, id LIMIT %s FOR UPDATE SKIP LOCKED",
        (ids["queue"], LEASE_BATCH),
    )
    tasks = c.fetchall()
    if not tasks:
        c.execute("COMMIT")
        return []
    leased = [(task_id, hexid(), epoch + 1) for task_id, epoch in tasks]
    c.executemany(
        "INSERT INTO orbit_attempt (id,task_id,namespace_id,application_id,queue_id,state,epoch,"
        "concurrency_key,worker_id,session_id,leased_at,lease_expires_at,outcome,retryable) VALUES "
        "(%s,%s,%s,%s,%s,'LEASED',%s,'','w0',%s,NOW(6),NOW(6)+INTERVAL 30 SECOND,'',0)",
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
    c.executemany(
        "INSERT INTO orbit_event (namespace_id,type,subject_id,data,created_at) VALUES "
        "(%s,'task.state_changed',%s,'{}',NOW(6))",
        [(ids["ns"], t) for t, _, _ in leased],
    )
    c.execute("COMMIT")
    return leased


def start(c, ids: dict, task_id: str, attempt_id: str) -> None:
    """tasks.actions.dispatch.approve_start: queue_state → task → attempt."""
    c.execute("SELECT * FROM orbit_attempt WHERE id=%s AND namespace_id=%s", (attempt_id, ids["ns"]))
    c.execute("BEGIN")
    c.execute("SELECT * FROM orbit_queue_state WHERE queue_id IN (%s) ORDER BY queue_id FOR UPDATE", (ids["queue"],))
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
    c.execute(
        "INSERT INTO orbit_event (namespace_id,type,subject_id,data,created_at) VALUES "
        "(%s,'task.state_changed',%s,'{}',NOW(6))",
        (ids["ns"], task_id),
    )
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
    c.execute("SELECT * FROM orbit_application_state WHERE application_id=%s FOR UPDATE", (ids["app"],))
    c.execute("SELECT * FROM orbit_queue_state WHERE queue_id IN (%s) ORDER BY queue_id FOR UPDATE", (ids["queue"],))
    c.execute("SELECT * FROM orbit_task WHERE id=%s FOR UPDATE", (task_id,))
    c.execute("SELECT * FROM orbit_attempt WHERE id=%s FOR UPDATE", (attempt_id,))
    c.execute(
        "UPDATE orbit_attempt SET state='SUCCEEDED', finished_at=NOW(6), outcome='SUCCEEDED' WHERE id=%s",
        (attempt_id,),
    )
    c.execute("UPDATE orbit_task SET state='SUCCEEDED', updated_at=NOW(6), finished_at=NOW(6) WHERE id=%s", (task_id,))
    c.execute(
        "INSERT INTO orbit_event (namespace_id,type,subject_id,data,created_at) VALUES "
        "(%s,'task.state_changed',%s,'{}',NOW(6))",
        (ids["ns"], task_id),
    )
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--run", type=int, default=0)
    args = parser.parse_args()
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
        print(json.dumps(out))
    finally:
        db.close()
        admin = MySQLdb.connect(host="127.0.0.1", user="root", passwd="")
        admin.cursor().execute(f"DROP DATABASE IF EXISTS `{database}`")
        admin.close()


if __name__ == "__main__":
    main()

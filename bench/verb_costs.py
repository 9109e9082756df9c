"""Per-verb cost of Orbit's transactions, in-process on MariaDB (no HTTP, no WebSocket).

Runs N tasks through submit → lease → start → result sequentially from one
thread and prints milliseconds, this process's CPU milliseconds and SQL
statements per verb. This is the number every other figure is built on: the
application_state row lock is held for (roughly) one of these transactions at
a time.

    .venv/bin/python -m bench.verb_costs --tasks 500
    .venv/bin/python -m bench.verb_costs --tasks 2000 --handoff
    .venv/bin/python -m bench.verb_costs --tasks 3000 --round-size 56 --drain

`--handoff` times instead the keyed hand-off of W2 at one key: N tasks of one
key (no policy), each round the result of the running one and the lease that
hands the key on and starts the next ahead (what one result frame with its
next Start costs the server), with the CPU time of this process per round.
`--drain` times W1's drain as its lane sees it: `--round-size` running unkeyed
tasks, each round their results sent with start_next and each one's lease
starting the next waiting task in the slot it frees.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument("--database", default="orbit_verbs")
    parser.add_argument("--round-size", type=int, default=4, help="results, starts and leases per pipelined round")
    parser.add_argument("--submits", action="store_true", help="each round also admits round-size submits")
    parser.add_argument("--profile", help="write a cProfile of the rounds to this file")
    parser.add_argument("--show-sql", action="store_true", help="print the statements of one pipelined round")
    parser.add_argument("--handoff", action="store_true", help="time the keyed hand-off round instead (W2, one key)")
    parser.add_argument(
        "--drain", action="store_true", help="time the unkeyed hand-off round instead (W1's drain, round-size slots)"
    )
    args = parser.parse_args()
    import MySQLdb

    db = MySQLdb.connect(host="127.0.0.1", user="root", passwd="")
    db.cursor().execute(f"DROP DATABASE IF EXISTS `{args.database}`")
    db.cursor().execute(f"CREATE DATABASE `{args.database}` CHARACTER SET utf8mb4")
    os.environ["ORBIT_MYSQL_DSN"] = f"mysql://root:@127.0.0.1:3306/{args.database}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from orbit.idempotency import run_idempotent
    from orbit.principal import Actor, authenticate_token
    from orbit.tenancy import ensure_application, ensure_namespace, issue_credential
    from queues.actions import QueueLimits, queue_create
    from tasks.actions import context, dispatch, rounds, submit
    from tasks.serializers import SubmitTaskInput

    application = ensure_application("verbs")
    namespace = ensure_namespace(application, "bench", "verbs")
    issued = issue_credential(namespace, scopes=["queues:manage", "tasks:submit"], queue_ids=None)
    principal = authenticate_token(issued.token)
    actor = Actor(principal=principal, request_id="0" * 32)
    queue = run_idempotent(
        actor=actor,
        key="q",
        operation="queue.create",
        target="",
        body={},
        validate=lambda: None,
        effect=lambda _: (
            201,
            {"queue": queue_create(actor=actor, name="verbs", limits=QueueLimits(100000, 1000000, 1000000))},
        ),
    ).data["queue"]
    worker = context.WorkerContext(
        namespace_id=namespace.id,
        application_id=application.id,
        worker_id="w",
        session_id="s" * 32,
        queue_ids=(queue["id"],),
        handlers=(),
        concurrency_keys=True,
    )

    def timed(label: str, fn, count: int, profile_to: str | None = None) -> None:
        seconds, cpu, statements = measured(fn, profile_to)
        print(
            f"{label:8s} {seconds / count * 1000:7.3f} ms/task  {cpu / count * 1000:7.3f} cpu ms/task"
            f"  {statements / count:5.1f} statements/task"
        )

    body = {"queue_id": queue["id"], "handler": "h", "handler_version": "v1", "payload_version": "v1", "payload": {}}

    def submit_all() -> None:
        for n in range(args.tasks):

            def validate() -> dict:
                serializer = SubmitTaskInput(data=body)
                serializer.is_valid(raise_exception=True)
                return serializer.validated_data

            run_idempotent(
                actor=actor,
                key=f"t{n}",
                operation="task.submit",
                target="",
                body=body,
                validate=validate,
                effect=lambda f: (201, submit.admit_one(actor=actor, fields=f)),
            )

    assignments: list[dict] = []

    def lease_all() -> None:
        while len(assignments) < args.tasks:
            assignments.extend(rounds.lease_tasks(worker=worker, limit=16))

    def start_all() -> None:
        for a in assignments:
            rounds.approve_start(worker=worker, attempt_id=a["attempt_id"], epoch=a["epoch"])

    def result_all() -> None:
        for a in assignments:
            rounds.record_result(
                worker=worker,
                attempt_id=a["attempt_id"],
                epoch=a["epoch"],
                outcome="SUCCEEDED",
                retryable=False,
                output=None,
                error=None,
            )

    if args.handoff:
        handoff(worker, actor, {**body, "concurrency_key": "object/1"}, args.tasks, args.profile)
        return
    if args.drain:
        drain(worker, actor, body, args.tasks, args.round_size, args.profile, args.show_sql)
        return

    timed("submit", submit_all, args.tasks)
    timed("lease", lease_all, args.tasks)
    timed("start", start_all, args.tasks)
    timed("result", result_all, args.tasks)

    # The server's steady state (tasks.actions.rounds): each round carries the
    # results of the previous round's starts, the starts of its leases, and
    # `size` lease requests of one task each, as several busy workers send them.
    from tasks.actions import batch
    from tasks.actions.endings import ResultReport
    from tasks.actions.rounds import LeaseRequest, SubmitRequest

    size = args.round_size
    admit(actor, body, args.tasks)
    leased: list[dict] = []
    started: list[dict] = []
    round_count = 0

    def pipeline() -> None:
        nonlocal leased, started, round_count
        done = 0
        while done < args.tasks:
            items = [ResultReport(worker, a["attempt_id"], a["epoch"], "SUCCEEDED", False, None, None) for a in started]
            items += [dispatch.StartRequest(worker, a["attempt_id"], a["epoch"]) for a in leased]
            items += [
                SubmitRequest(actor, batch.checked_submission(actor, f"r{round_count}-{n}", body))
                for n in range(size if args.submits else 0)
            ]
            items += [LeaseRequest(worker, 1) for _ in range(size)]
            submits = f"{size} submits, " if args.submits else ""
            title = f"one round of {submits}{len(started)} results, {len(leased)} starts, {size} leases:"
            answers = run_round_shown(items, title, args.show_sql and round_count == 10)
            done += len(started)
            started, leased = leased, [a for answer in answers[len(items) - size :] for a in answer.assignments]
            round_count += 1

    timed("round", pipeline, args.tasks, args.profile)
    print(f"         {args.tasks / max(round_count, 1):7.1f} tasks/round")


def admit(actor, body: dict, count: int) -> None:
    """`count` waiting tasks of `body`, each admitted in a transaction of its own."""
    from django.db import transaction

    from tasks.actions import submit
    from tasks.serializers import SubmitTaskInput

    serializer = SubmitTaskInput(data=body)
    serializer.is_valid(raise_exception=True)
    for _ in range(count):
        with transaction.atomic():
            submit.admit_one(actor=actor, fields=serializer.validated_data)


def running_tasks(worker, count: int) -> list[dict]:
    """`count` waiting tasks leased to `worker` and started."""
    from tasks.actions import rounds

    running: list[dict] = []
    while len(running) < count:
        running += rounds.lease_tasks(worker=worker, limit=count - len(running))
    for assignment in running:
        rounds.approve_start(worker=worker, attempt_id=assignment["attempt_id"], epoch=assignment["epoch"])
    return running


def run_round_shown(items: list, title: str, show: bool) -> list:
    """run_round(items); with `show`, its statements printed under `title`."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tasks.actions.rounds import run_round

    if not show:
        return run_round(items)
    with CaptureQueriesContext(connection) as captured:
        answers = run_round(items)
    print(title)
    for query in captured.captured_queries:
        print(f"    {float(query['time']) * 1000:6.2f} ms", query["sql"][:140])
    return answers


def measured(fn, profile_to: str | None) -> tuple[float, float, int]:
    """Runs `fn` (under cProfile, written to `profile_to`, if given): its
    seconds, this process's CPU seconds, and the statements it sent."""
    from django.db import connection

    statements = 0

    def counter(execute, sql, params, many, context):
        nonlocal statements
        statements += 1
        return execute(sql, params, many, context)

    with connection.execute_wrapper(counter):
        cpu, began = time.process_time(), time.perf_counter()
        if profile_to:
            import cProfile

            with cProfile.Profile() as profile:
                fn()
            profile.dump_stats(profile_to)
        else:
            fn()
        return time.perf_counter() - began, time.process_time() - cpu, statements


def handoff(worker, actor, body: dict, tasks: int, profile_to: str | None) -> None:
    from tasks.actions.endings import ResultReport
    from tasks.actions.rounds import LeaseRequest, run_round

    admit(actor, body, tasks + 1)
    (running,) = running_tasks(worker, 1)
    start_ahead = (body["handler"], body["handler_version"])

    def rounds_of_handoff() -> None:
        nonlocal running
        for _ in range(tasks):
            report = ResultReport(worker, running["attempt_id"], running["epoch"], "SUCCEEDED", False, None, None)
            answers = run_round([report, LeaseRequest(worker, 1, after=report, start_ahead=start_ahead)])
            (running,) = answers[1].assignments

    seconds, cpu, round_trips = measured(rounds_of_handoff, profile_to)
    print(
        f"handoff  {seconds / tasks * 1000:7.3f} ms/round  {cpu / tasks * 1000:7.3f} cpu ms/round"
        f"  {round_trips / tasks:5.1f} round trips/round"
    )


def drain(worker, actor, body: dict, tasks: int, slots: int, profile_to: str | None, show_sql: bool) -> None:
    """W1's drain as the lane sees it: `slots` running unkeyed tasks; each
    round carries their results, sent with start_next, and each one's lease
    into the slot it frees, starting the next waiting task there."""
    from tasks.actions.endings import ResultReport
    from tasks.actions.rounds import LeaseRequest

    admit(actor, body, tasks + slots)
    running = running_tasks(worker, slots)
    start_ahead = (body["handler"], body["handler_version"])
    rounds_run = 0

    def one_round() -> None:
        nonlocal running, rounds_run
        items: list = []
        for assignment in running:
            report = ResultReport(worker, assignment["attempt_id"], assignment["epoch"], "SUCCEEDED", False, None, None)
            items += [report, LeaseRequest(worker, 1, after=report, start_ahead=start_ahead)]
        title = f"one round of {len(running)} results, each with its hand-off:"
        answers = run_round_shown(items, title, show_sql and rounds_run == 10)
        running = [a for answer in answers[1::2] for a in answer.assignments]
        rounds_run += 1

    def all_rounds() -> None:
        done = 0
        while done < tasks:
            done += len(running)
            one_round()

    seconds, cpu, statements = measured(all_rounds, profile_to)
    done = rounds_run * slots
    print(
        f"drain    {seconds / done * 1000:7.3f} ms/task  {cpu / done * 1000:7.3f} cpu ms/task"
        f"  {statements / rounds_run:5.1f} statements/round  {slots} tasks/round"
    )


if __name__ == "__main__":
    main()

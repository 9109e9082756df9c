"""What key policies cost a lease, in-process on MariaDB (no HTTP, no WebSocket).

Two applications in one fresh database, each with a namespace, a queue and N keyed
tasks: "none" has no key policy (every key capacity 1, no rate, the seed's mutex);
"policies" has 1,000 live policies (900 prefixes and 100 exact keys, capacity 4, one in
five with a start rate loose enough never to bind) and 100,000 key rows of earlier
keys under them. Both then run the same sequence from one thread: lease (up to 16 a
call), Start and result for every task; the tasks' keys match some of the policies
(the "policies" case) and each key is shared by two tasks, so a key row with
capacity 4 grants a slot row too. Prints ms per task for the lease alone and for the
whole cycle, each case's median over the repetitions, and the ratio policies / none
(the goal: within 1.5).

    .venv/bin/python -m bench.lease_policies --tasks 2000 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

POLICIES = 1000
EXACT = 100  # of POLICIES, exact-key policies; the rest prefixes
RATED_EVERY = 5  # every fifth policy has a rate
KEY_ROWS = 100_000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=2000, help="keyed tasks per case and repetition")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--database", default=f"bench_lease_policies_{os.getpid()}")
    args = parser.parse_args()
    import MySQLdb

    db = MySQLdb.connect(host="127.0.0.1", user="root", passwd="")
    db.cursor().execute(f"DROP DATABASE IF EXISTS `{args.database}`")
    db.cursor().execute(f"CREATE DATABASE `{args.database}` CHARACTER SET utf8mb4")
    os.environ["ORBIT_MYSQL_DSN"] = f"mysql://root:@127.0.0.1:3306/{args.database}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")
    try:
        run(args)
    finally:
        db.cursor().execute(f"DROP DATABASE IF EXISTS `{args.database}`")
        db.close()


def run(args: argparse.Namespace) -> None:
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import transaction
    from django.utils import timezone

    call_command("migrate", verbosity=0)
    from orbit.idempotency import run_idempotent
    from orbit.models import Application
    from orbit.principal import Actor, authenticate_token
    from orbit.tenancy import ensure_application, ensure_namespace, issue_credential
    from queues.actions import QueueLimits, queue_create
    from tasks.actions import context, rounds, submit
    from tasks.models import ConcurrencyKey, KeyMatch, KeyPolicy
    from tasks.serializers import SubmitTaskInput

    def case(name: str) -> tuple[Actor, context.WorkerContext, str, str]:
        application = ensure_application(f"lease-{name}")
        namespace = ensure_namespace(application, "bench", name)
        issued = issue_credential(namespace, scopes=["queues:manage", "tasks:submit"], queue_ids=None)
        actor = Actor(principal=authenticate_token(issued.token), request_id="0" * 32)
        queue = run_idempotent(
            actor=actor,
            key=f"q-{name}",
            operation="queue.create",
            target="",
            body={},
            validate=lambda: None,
            effect=lambda _: (
                201,
                {"queue": queue_create(actor=actor, name=name, limits=QueueLimits(100000, 1000000, 1000000))},
            ),
        ).data["queue"]
        worker = context.WorkerContext(
            namespace_id=namespace.id,
            application_id=application.id,
            worker_id=f"w-{name}",
            session_id="s" * 32,
            queue_ids=(queue["id"],),
            handlers=(),
            concurrency_keys=True,
        )
        return actor, worker, queue["id"], application.id

    cases = {name: case(name) for name in ("none", "policies")}

    # The policies and the key rows of earlier keys under them, written directly (their
    # verbs' cost is not what this measures), then the application's generation moved
    # as a policy verb moves it, so the lease reads them.
    _, worker, _, application_id = cases["policies"]
    now = timezone.now()
    policies = []
    for n in range(POLICIES):
        exact = n < EXACT
        rated = n % RATED_EVERY == 0
        policies.append(
            KeyPolicy(
                namespace_id=worker.namespace_id,
                match_kind=KeyMatch.KEY if exact else KeyMatch.PREFIX,
                match_value=f"x{n:04d}" if exact else f"p{n:04d}/",
                capacity=4,
                rate_starts=100000 if rated else None,
                rate_per_seconds=1 if rated else None,
                rate_burst=100000 if rated else None,
                revision=1,
                live=True,
                applied_revision=1,
                created_at=now,
                updated_at=now,
            )
        )
    KeyPolicy.objects.bulk_create(policies, batch_size=1000)
    rows = [
        ConcurrencyKey(
            namespace_id=worker.namespace_id,
            key=f"p{EXACT + n % (POLICIES - EXACT):04d}/old-{n}",
            version=2,
            capacity=4,
            updated_at=now,
        )
        for n in range(KEY_ROWS)
    ]
    ConcurrencyKey.objects.bulk_create(rows, batch_size=5000)
    Application.objects.filter(id=application_id).update(key_policy_generation=1)

    def key_of(name: str, repetition: int, n: int) -> str:
        pair = n // 2  # two tasks per key
        if name == "none":
            return f"k{repetition}-{pair}"
        # Keys under a fifth of the prefix policies (rated ones among them), and every
        # twentieth key an exact policy's own.
        if pair % 20 == 0:
            return f"x{pair // 20 % EXACT:04d}"
        return f"p{EXACT + pair % 180:04d}/r{repetition}-{pair}"

    def load(name: str, repetition: int) -> None:
        actor, _, queue_id, _ = cases[name]
        for n in range(args.tasks):
            body = {
                "queue_id": queue_id,
                "handler": "h",
                "handler_version": "v1",
                "payload_version": "v1",
                "payload": {},
                "concurrency_key": key_of(name, repetition, n),
            }
            serializer = SubmitTaskInput(data=body)
            serializer.is_valid(raise_exception=True)
            with transaction.atomic():
                submit.admit_one(actor=actor, fields=serializer.validated_data)

    def cycle(name: str) -> tuple[float, float]:
        """Lease, Start and result until every loaded task is done: (lease s, whole s)."""
        _, worker, _, _ = cases[name]
        leasing = 0.0
        done = 0
        began = time.perf_counter()
        while done < args.tasks:
            t0 = time.perf_counter()
            assignments = rounds.lease_tasks(worker=worker, limit=16)
            leasing += time.perf_counter() - t0
            if not assignments:
                raise RuntimeError(f"{name}: nothing to lease with {args.tasks - done} tasks left")
            for a in assignments:
                rounds.approve_start(worker=worker, attempt_id=a["attempt_id"], epoch=a["epoch"])
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
            done += len(assignments)
        return leasing, time.perf_counter() - began

    figures: dict[str, dict[str, list[float]]] = {name: {"lease": [], "cycle": []} for name in cases}
    for repetition in range(args.repeat):
        for name in ("none", "policies") if repetition % 2 == 0 else ("policies", "none"):
            load(name, repetition)
            leasing, whole = cycle(name)
            figures[name]["lease"].append(leasing / args.tasks * 1000)
            figures[name]["cycle"].append(whole / args.tasks * 1000)
            print(
                f"run {repetition + 1} {name:8s} lease {figures[name]['lease'][-1]:6.3f} ms/task  "
                f"lease+start+result {figures[name]['cycle'][-1]:6.3f} ms/task",
                flush=True,
            )
    summary: dict[str, float] = {"tasks": args.tasks, "repeat": args.repeat, "policies": POLICIES, "key_rows": KEY_ROWS}
    for name in cases:
        for part in ("lease", "cycle"):
            summary[f"{part}_ms_per_task_{name}"] = round(statistics.median(figures[name][part]), 3)
    for part in ("lease", "cycle"):
        summary[f"{part}_ratio_policies_vs_none"] = round(
            summary[f"{part}_ms_per_task_policies"] / summary[f"{part}_ms_per_task_none"], 2
        )
    print(
        f"lease: {summary['lease_ms_per_task_policies']} vs {summary['lease_ms_per_task_none']} ms/task, "
        f"ratio {summary['lease_ratio_policies_vs_none']}; lease+start+result: "
        f"{summary['cycle_ms_per_task_policies']} vs {summary['cycle_ms_per_task_none']} ms/task, "
        f"ratio {summary['cycle_ratio_policies_vs_none']} (goal: within 1.5)"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

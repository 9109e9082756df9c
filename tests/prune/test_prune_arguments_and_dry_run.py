"""orbit_prune's DURATION values (one clear error line, never a
traceback) and --dry-run (changes nothing; reports exactly what a real run
removes), over a history with dependencies, retries, cancels and keys."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db.models import F

from orbit.models import Event, IdempotencyRecord
from tasks.invariants import find_violations
from tasks.models import Attempt, ConcurrencyKey, DependencySettlement, Task, TaskDependency
from tests.support.api import make_queue
from tests.support.tasks import cancel, ends_unknown, lease_one, report, start, submit_ok

ROOT = Path(__file__).resolve().parents[2]
OLD = timedelta(days=40)


def prune(*args: str) -> str:
    out = io.StringIO()
    call_command("orbit_prune", *args, stdout=out)
    return out.getvalue()


SUMMARY = re.compile(
    r"(?:would remove|removed) (\d+) tasks, (\d+) attempts, (\d+) events, (\d+) idempotency records"
    r" in [0-9.]+ s; kept (.*)"
)


def summary(out: str) -> tuple:
    return SUMMARY.search(out).groups()


@pytest.mark.django_db
def test_bad_durations_are_one_clear_refusal():
    refused = {}
    for bad in ("", " ", "30", "d", "1.5d", "-1d", "3w", "30D", "30 d", "1_0d", "\u0663d", "+3d", "0x1d", "30d5h"):
        for flag in ("--finished-before", "--idempotency-before"):
            args = (
                [f"--finished-before={bad}"]
                if flag == "--finished-before"
                else ["--finished-before=30d", f"{flag}={bad}"]
            )
            try:
                prune(*args, "--dry-run")
            except CommandError as error:
                refused[(flag, bad)] = str(error)
                assert "\n" not in str(error)
            # any other exception fails the test here (a traceback)
    accepted = [
        key
        for key in [
            (f, b)
            for f in ("--finished-before", "--idempotency-before")
            for b in ("", " ", "30", "d", "1.5d", "-1d", "3w", "30D", "30 d", "1_0d", "\u0663d", "+3d", "0x1d", "30d5h")
        ]
        if key not in refused
    ]
    unnamed = sorted(
        {bad for (flag, bad), message in refused.items() if flag == "--idempotency-before" and flag not in message}
    )
    problems = []
    if accepted:
        problems.append(f"bad DURATION values run silently: {accepted}")
    if unnamed:
        problems.append(
            f"--idempotency-before refusals that do not name the flag (read as --finished-before's): {unnamed[:3]}"
        )
    assert problems == []


@pytest.mark.django_db
@pytest.mark.parametrize("value", ["700000d", "3000000d", "99999999h"])
def test_far_bounds_inside_the_calendar_are_handled(value):
    """A bound the parser takes (a year between 1 and 1000, out of DATETIME's range)."""
    try:
        out = prune("--finished-before", value, "--dry-run")
    except CommandError as error:
        assert "\n" not in str(error)
        return
    assert "would remove 0 tasks" in out


def test_the_command_line_says_a_bad_duration_in_one_line():
    env = {**os.environ}
    env.pop("ORBIT_MYSQL_DSN", None)  # no database is needed to refuse an argument
    env["ORBIT_SQLITE_PATH"] = "/tmp/orbit-prune-none.sqlite3"
    results = {}
    # (`--finished-before -1d` is argparse's: "-1d" reads as an option, and its usage lines follow.)
    for args in (
        ["--finished-before=-1d"],
        ["--finished-before", "3w"],
        ["--finished-before=30d", "--idempotency-before="],
    ):
        done = subprocess.run(
            [sys.executable, "manage.py", "orbit_prune", *args, "--dry-run"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        results[tuple(args)] = (done.returncode, done.stderr.strip().splitlines())
    for args, (code, lines) in results.items():
        assert code != 0 and "Traceback" not in "\n".join(lines), (args, code, lines)
    bad = {args: lines for args, (code, lines) in results.items() if len(lines) != 1}
    assert not bad, f"more than one line: {bad}"


@pytest.mark.django_db
def test_a_dry_run_reports_exactly_what_the_real_run_removes(tenant):
    client = tenant.client
    queue = make_queue(client, max_concurrency=50, rate_per_second=100_000)
    q = queue["id"]
    hold = make_queue(client, "hold")["id"]  # never leased from: its tasks stay unfinished

    def run(key: str, outcome: str = "SUCCEEDED", **extra):
        task = submit_ok(client, q, key, **extra)
        lease = lease_one(tenant, q)
        assert Attempt.objects.get(id=lease["attempt_id"]).task_id == task["id"]
        start(lease)
        report(lease, outcome, output={"k": key}, error=None if outcome == "SUCCEEDED" else {"code": "x"})
        return task["id"]

    # P1 done; C1 submitted after (WAITING, unfinished): P1 is kept
    p1 = run("p1")
    c1 = submit_ok(client, hold, "c1", depends_on=[p1])["id"]
    # P2 running, C2 BLOCKED on it, P2 done -> C2 WAITING -> C2 done: both go
    t = submit_ok(client, q, "p2")
    lease = lease_one(tenant, q)
    start(lease)
    c2 = submit_ok(client, q, "c2", depends_on=[t["id"]])["id"]
    report(lease, "SUCCEEDED", output={"x": 1})
    p2 = t["id"]
    lease = lease_one(tenant, q)
    start(lease)
    report(lease, "SUCCEEDED")
    # P3 fails; C3 (on_dependency_failure CANCEL) cancelled at once; a keyed one; a cancelled one
    p3 = run("p3", "FAILED")
    c3 = submit_ok(client, q, "c3", depends_on=[p3], on_dependency_failure="CANCEL")["id"]
    keyed = run("k1", concurrency_key="printer")
    cancelled = submit_ok(client, q, "x1")["id"]
    assert cancel(client, cancelled, "cancel-x1").status_code == 200
    assert cancel(client, cancelled, "cancel-x1-again").status_code == 200
    # A review task (kept) and a chain: P4 done, C4 done, D4 (unfinished) depends on C4
    review = submit_ok(client, q, "rv")["id"]
    ends_unknown(tenant, q)
    p4 = run("p4")
    c4t = submit_ok(client, q, "c4", depends_on=[p4])
    lease = lease_one(tenant, q)
    start(lease)
    report(lease, "SUCCEEDED")
    c4 = c4t["id"]
    d4 = submit_ok(client, hold, "d4", depends_on=[c4])["id"]
    states = dict(Task.objects.values_list("id", "state"))
    assert states[c1] == "WAITING" and states[c2] == "SUCCEEDED" and states[c3] == "CANCELLED", states
    assert states[c4] == "SUCCEEDED" and states[d4] == "WAITING" and states[review] == "NEEDS_REVIEW"
    # The whole history moves back (ids and times keep growing together, as in production).
    for task in Task.objects.all():
        Task.objects.filter(id=task.id).update(
            created_at=task.created_at - OLD, finished_at=task.finished_at - OLD if task.finished_at else None
        )
    Event.objects.update(created_at=F("created_at") - OLD)
    IdempotencyRecord.objects.update(created_at=F("created_at") - OLD)
    recent = run("recent")

    def tables():
        return (
            sorted(Task.objects.values_list("id", "state")),
            sorted(Attempt.objects.values_list("id", "state")),
            sorted(TaskDependency.objects.values_list("task_id", "depends_on_id", "settled")),
            DependencySettlement.objects.count(),
            sorted(Event.objects.values_list("id", flat=True)),
            sorted(IdempotencyRecord.objects.values_list("id", flat=True)),
            sorted(ConcurrencyKey.objects.values_list("namespace_id", "key", "version")),
        )

    before = tables()
    counts_before = (
        Task.objects.count(),
        Attempt.objects.count(),
        Event.objects.count(),
        IdempotencyRecord.objects.count(),
    )
    dry = prune("--finished-before", "30d", "--dry-run", "--batch-size", "2")
    assert tables() == before, "the dry run changed rows"
    real = prune("--finished-before", "30d", "--batch-size", "2")
    counts_after = (
        Task.objects.count(),
        Attempt.objects.count(),
        Event.objects.count(),
        IdempotencyRecord.objects.count(),
    )
    removed = tuple(a - b for a, b in zip(counts_before, counts_after, strict=True))
    assert summary(dry) == summary(real)
    assert tuple(int(n) for n in summary(real)[:4]) == removed
    left = set(Task.objects.values_list("id", flat=True))
    assert {p1, c1, review, c4, d4, recent} <= left  # kept: an unfinished dependent, unfinished, review
    assert not left & {p2, c2, p3, c3, keyed, cancelled, p4}
    assert find_violations() == []

"""Housekeeping of dependencies (SPEC §13): orbit_check finds each way the
graph can disagree with its tasks (each produced here by corrupting rows
directly) and nothing after the normal pipelines; orbit_prune keeps a
finished task while a dependent needs it, then removes it with its edges."""

from __future__ import annotations

import copy
import io
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.utils import timezone

from orbit.fields import new_id
from tasks.actions.dependencies import INLINE_EDGES, run_follow_ups
from tasks.actions.permits import settle
from tasks.invariants import find_violations
from tasks.models import Attempt, DependencySettlement, Task, TaskDependency
from tests.support.dependencies import fan_out, run_one
from tests.support.tasks import cancel, lease_one, submit_ok

pytestmark = [pytest.mark.mysql_only, pytest.mark.django_db]

OLD = timedelta(days=40)


def check() -> tuple[int, str, str]:
    """orbit_check as an operator runs it: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command("orbit_check", stdout=out, stderr=err)
    except CommandError as failure:
        return 1, out.getvalue(), err.getvalue() + str(failure)
    return 0, out.getvalue(), err.getvalue()


def assert_one_finding(expected: str) -> None:
    assert find_violations() == [expected]
    code, _, err = check()
    assert code == 1 and expected in err and "1 invariant violations" in err


def assert_clean() -> None:
    assert find_violations() == []
    code, out, _ = check()
    assert code == 0 and out.startswith("orbit_check: ok")


# --- orbit_check: each finding from rows corrupted directly ----------------


def test_a_blocked_task_with_every_edge_settled_is_stuck(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    run_one(tenant, queue["id"])
    assert_clean()
    Task.objects.filter(id=child["id"]).update(state="BLOCKED")  # the transition to WAITING lost
    assert_one_finding(
        f"task {child['id']}: BLOCKED (blocked_by=0) but all its dependency edges are settled: nothing will move it"
    )


def test_blocked_by_must_count_the_unsettled_edges(tenant, queue):
    parents = [submit_ok(tenant.client, queue["id"], f"p-{n}")["id"] for n in range(2)]
    join = submit_ok(tenant.client, queue["id"], "join", depends_on=parents)
    assert_clean()
    Task.objects.filter(id=join["id"]).update(blocked_by=1)
    assert_one_finding(f"task {join['id']}: BLOCKED with blocked_by=1 but 2 unsettled edges")


@pytest.mark.parametrize("policy", ["CANCEL", "RUN"])
def test_a_task_past_blocked_before_every_dependency_finished(tenant, queue, policy):
    done = submit_ok(tenant.client, queue["id"], "done", max_attempts=1)
    run_one(tenant, queue["id"], "FAILED" if policy == "RUN" else "SUCCEEDED")
    open_parent = submit_ok(tenant.client, queue["id"], "open")
    child = submit_ok(
        tenant.client, queue["id"], "child", depends_on=[done["id"], open_parent["id"]], on_dependency_failure=policy
    )
    assert Task.objects.get(id=child["id"]).state == "BLOCKED"
    assert_clean()
    # Released early: even under RUN it waits for every dependency to finish.
    TaskDependency.objects.filter(task_id=child["id"]).update(settled=True)
    Task.objects.filter(id=child["id"]).update(state="WAITING", blocked_by=0)
    assert_one_finding(f"task {child['id']}: WAITING before its dependency {open_parent['id']} finished (WAITING)")
    # and leased so: the lease takes the open parent or the child; either way the child is reported
    Task.objects.filter(id=open_parent["id"]).update(available_at=timezone.now() + timedelta(hours=1))
    assert lease_one(tenant, queue["id"])["task"]["id"] == child["id"]
    assert_one_finding(f"task {child['id']}: LEASED before its dependency {open_parent['id']} finished (WAITING)")


def test_a_task_that_runs_although_a_dependency_failed_under_cancel(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    waiting = submit_ok(tenant.client, queue["id"], "waiting", depends_on=[parent["id"]])
    runner = submit_ok(tenant.client, queue["id"], "runner", depends_on=[parent["id"]], on_dependency_failure="RUN")
    run_one(tenant, queue["id"])
    ran = submit_ok(tenant.client, queue["id"], "ran", depends_on=[parent["id"]], priority=9)
    run_one(tenant, queue["id"])
    assert Task.objects.get(id=ran["id"]).state == "SUCCEEDED"
    assert_clean()
    Task.objects.filter(id=parent["id"]).update(state="FAILED")  # as if it had failed: CANCEL never ran them
    problems = find_violations()
    assert sorted(problems) == sorted(
        [
            f"task {waiting['id']}: WAITING although its dependency {parent['id']} ended FAILED "
            "under on_dependency_failure CANCEL",
            f"task {ran['id']}: ran (SUCCEEDED) although its dependency {parent['id']} ended FAILED "
            "under on_dependency_failure CANCEL",
        ]
    )
    assert not any(runner["id"] in problem for problem in problems)  # RUN runs after a failure


def test_a_dependent_left_behind_by_a_finished_dependency(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    waiting = submit_ok(tenant.client, queue["id"], "waiting", depends_on=[parent["id"]])
    run_one(tenant, queue["id"])
    assert_clean()
    TaskDependency.objects.filter(task_id=waiting["id"]).update(settled=False)
    assert_one_finding(
        f"dependency {parent['id']}: ended SUCCEEDED but 1 of its edges are unsettled (task {waiting['id']} first) "
        "and no settlement is pending: its dependents were left behind"
    )
    # Also when the dependent has finished since: the dependency is probed from its recent lease.
    run_one(tenant, queue["id"])
    assert Task.objects.get(id=waiting["id"]).state == "SUCCEEDED"
    assert_one_finding(
        f"dependency {parent['id']}: ended SUCCEEDED but 1 of its edges are unsettled (task {waiting['id']} first) "
        "and no settlement is pending: its dependents were left behind"
    )


def test_an_unfinished_dependent_missing_an_edge(tenant, queue):
    parents = [submit_ok(tenant.client, queue["id"], f"p-{n}")["id"] for n in range(2)]
    join = submit_ok(tenant.client, queue["id"], "join", depends_on=parents)
    TaskDependency.objects.filter(task_id=join["id"], depends_on_id=parents[1]).delete()
    Task.objects.filter(id=join["id"]).update(blocked_by=1)
    assert_one_finding(f"task {join['id']}: depends_on names 2 tasks but it has 1 edges")


def test_a_settlement_pending_for_more_than_a_minute_is_a_stuck_follow_up(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    fan_out(tenant, queue["id"], parent["id"], INLINE_EDGES + 20)
    run_one(tenant, queue["id"])
    # Half settled, its follow-up not run yet: the in-flight state is consistent.
    assert DependencySettlement.objects.filter(task_id=parent["id"]).exists()
    assert_clean()
    since = timezone.now() - timedelta(seconds=61)
    DependencySettlement.objects.filter(task_id=parent["id"]).update(created_at=since)
    (problem,) = find_violations()
    assert problem.startswith(f"dependency {parent['id']}: settlement pending since ")
    assert problem.endswith("more than 60 s: its follow-up is stuck")
    run_follow_ups(settle)
    assert_clean()


# --- orbit_check: clean after the normal pipelines -------------------------


def test_clean_along_a_chain(tenant, queue):
    previous = submit_ok(tenant.client, queue["id"], "link-0")
    for n in range(1, 6):
        previous = submit_ok(tenant.client, queue["id"], f"link-{n}", depends_on=[previous["id"]])
    assert_clean()
    for _ in range(6):
        run_one(tenant, queue["id"])
        assert_clean()
    assert Task.objects.get(id=previous["id"]).state == "SUCCEEDED"


def test_clean_through_a_fan_out_past_the_inline_budget(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    dependents = fan_out(tenant, queue["id"], parent["id"], INLINE_EDGES + 50)
    assert_clean()
    run_one(tenant, queue["id"])
    assert_clean()  # the follow-up's row is there, and fresh
    run_follow_ups(settle)
    assert Task.objects.filter(id__in=dependents, state="WAITING").count() == INLINE_EDGES + 50
    assert not DependencySettlement.objects.exists()
    assert_clean()


def test_clean_through_a_fan_in(tenant, queue):
    parents = [submit_ok(tenant.client, queue["id"], f"p-{n}")["id"] for n in range(5)]
    join = submit_ok(tenant.client, queue["id"], "join", depends_on=parents)
    for _ in parents:
        assert_clean()
        run_one(tenant, queue["id"])
    assert Task.objects.get(id=join["id"]).state == "WAITING"
    run_one(tenant, queue["id"])
    assert_clean()


def test_clean_after_a_cancel_cascade_and_under_run(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent", max_attempts=1)
    other = submit_ok(tenant.client, queue["id"], "other")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    grandchild = submit_ok(tenant.client, queue["id"], "grandchild", depends_on=[child["id"], other["id"]])
    runner = submit_ok(
        tenant.client, queue["id"], "runner", depends_on=[parent["id"], other["id"]], on_dependency_failure="RUN"
    )
    run_one(tenant, queue["id"], "FAILED")
    assert Task.objects.get(id=grandchild["id"]).state == "CANCELLED"
    assert Task.objects.get(id=runner["id"]).state == "BLOCKED"  # RUN waits for the rest
    assert_clean()
    run_one(tenant, queue["id"])  # other
    run_one(tenant, queue["id"])  # runner
    assert Task.objects.get(id=runner["id"]).state == "SUCCEEDED"
    # a cancelled dependency cancels its CANCEL dependents too
    head = submit_ok(tenant.client, queue["id"], "head")
    tail = submit_ok(tenant.client, queue["id"], "tail", depends_on=[head["id"]])
    assert cancel(tenant.client, head["id"], "cancel-head").status_code == 200
    assert Task.objects.get(id=tail["id"]).state == "CANCELLED"
    assert_clean()


# --- orbit_prune ------------------------------------------------------------


def prune(*args: str) -> str:
    out = io.StringIO()
    bound = () if "--finished-before" in args else ("--finished-before", "30d")
    call_command("orbit_prune", *bound, *args, stdout=out)
    return out.getvalue()


def age(task_ids: list[str]) -> None:
    """Moves these finished tasks' finish OLD into the past."""
    for task in Task.objects.filter(id__in=task_ids):
        Task.objects.filter(id=task.id).update(finished_at=task.finished_at - OLD, created_at=task.created_at - OLD)


def test_prune_keeps_a_dependency_while_its_dependent_is_unfinished_then_drops_both(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    run_one(tenant, queue["id"])
    age([parent["id"]])
    assert "kept 1 tasks an unfinished task depends on" in prune("--dry-run")
    out = prune()
    assert "removed 0 tasks" in out and "kept 1 tasks an unfinished task depends on" in out
    assert Task.objects.filter(id=parent["id"]).exists()
    # a dependent admitted WAITING after its dependency ended holds it just the same
    late = submit_ok(tenant.client, queue["id"], "late", depends_on=[parent["id"]])
    assert late["state"] == "WAITING"
    run_one(tenant, queue["id"])  # child
    assert "kept 1 tasks an unfinished task depends on" in prune()
    run_one(tenant, queue["id"])  # late: every dependent has finished
    age([child["id"], late["id"]])
    assert "would remove 3 tasks, 3 attempts" in prune("--dry-run")
    out = prune("--batch-size", "1")
    assert "removed 3 tasks, 3 attempts" in out and "kept nothing" in out
    gone = [parent["id"], child["id"], late["id"]]
    assert not Task.objects.filter(id__in=gone).exists()
    assert not TaskDependency.objects.filter(task_id__in=gone).exists()
    assert not TaskDependency.objects.filter(depends_on_id__in=gone).exists()
    assert not DependencySettlement.objects.exists()
    assert_clean()


def test_prune_keeps_a_dependency_whose_settlement_is_pending(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    dependents = fan_out(tenant, queue["id"], parent["id"], INLINE_EDGES + 10)
    for n, task_id in enumerate(dependents):  # every dependent finished before its dependency did
        assert cancel(tenant.client, task_id, f"cancel-{n}").status_code == 200
    run_one(tenant, queue["id"])
    assert DependencySettlement.objects.filter(task_id=parent["id"]).exists()
    age([parent["id"], *dependents])
    out = prune()
    assert f"removed {len(dependents)} tasks" in out and "kept 1 tasks whose dependents are not all settled" in out
    assert Task.objects.filter(id=parent["id"]).exists()
    assert not TaskDependency.objects.filter(task_id__in=dependents).exists()
    run_follow_ups(settle)
    assert not DependencySettlement.objects.exists()
    out = prune()
    assert "removed 1 tasks, 1 attempts" in out and "kept nothing" in out
    assert not Attempt.objects.filter(task_id=parent["id"]).exists()
    assert_clean()


def test_prune_keeps_a_dependency_with_an_edge_left_unsettled(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    run_one(tenant, queue["id"])
    run_one(tenant, queue["id"])
    TaskDependency.objects.filter(task_id=child["id"]).update(settled=False)  # orbit_check reports it
    age([parent["id"]])
    assert "kept 1 tasks whose dependents are not all settled" in prune()
    assert Task.objects.filter(id=parent["id"]).exists()


def explain(statement: str) -> list[dict]:
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {statement}")
        columns = [column[0] for column in cursor.description]
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]


BIG_TABLES = ("orbit_task", "orbit_task_dependency", "orbit_attempt")


def scans(plan: list[dict], aliases: dict[str, str]) -> list[dict]:
    """The plan's rows that read a big table whole (a table or full index
    scan), but for the newest leases read backwards along idx_attempt_leased
    under a LIMIT."""
    return [
        row
        for row in plan
        if aliases.get(row["table"], row["table"]) in BIG_TABLES
        and row["type"] in ("ALL", "index")
        and row["key"] != "idx_attempt_leased"
    ]


@pytest.fixture
def graph(tenant, queue):
    """A fan-out of 50 settled, a BLOCKED join of two, a finished chain of
    5,000 tasks, analysed (ANALYZE commits: the tests that use it commit)."""
    parent = submit_ok(tenant.client, queue["id"], "parent")
    fan_out(tenant, queue["id"], parent["id"], 50)
    run_one(tenant, queue["id"])
    heads = [submit_ok(tenant.client, queue["id"], f"head-{n}")["id"] for n in range(2)]
    submit_ok(tenant.client, queue["id"], "join", depends_on=heads)
    finished = Task.objects.get(id=parent["id"])
    history = []
    for _ in range(5000):
        finished.id = new_id()
        finished.has_dependents = False
        history.append(copy.copy(finished))
    Task.objects.bulk_create(history, batch_size=1000)
    chain = [
        TaskDependency(
            namespace_id=finished.namespace_id, task_id=task.id, depends_on_id=previous.id, position=0, settled=True
        )
        for previous, task in zip(history, history[1:], strict=False)
    ]
    TaskDependency.objects.bulk_create(chain, batch_size=1000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE TABLE orbit_task_dependency, orbit_task, orbit_attempt")
    return parent["id"]


@pytest.mark.django_db(transaction=True)
def test_the_prunes_dependency_check_probes_the_parent_index(graph):
    """Per task, each semi-join is a range of idx_dependency_parent (and the
    dependents by primary key): never a scan of the edges or the tasks."""
    from django.test.utils import CaptureQueriesContext

    from tasks.management.commands.orbit_prune import KEPT_FOR_DEPENDENT, held_by_dependents

    batch = [graph, *Task.objects.exclude(id=graph).filter(state="SUCCEEDED").values_list("id", flat=True)[:499]]
    with CaptureQueriesContext(connection) as queries:
        assert held_by_dependents(batch) == {graph: KEPT_FOR_DEPENDENT}
    plan = explain(queries.captured_queries[0]["sql"])
    print("\n" + "\n".join(str(row) for row in plan))
    assert len([row for row in plan if row["key"] == "idx_dependency_parent"]) == 2, plan
    assert scans(plan, {"U0": "orbit_task_dependency", "V0": "orbit_task_dependency", "U1": "orbit_task"}) == []


@pytest.mark.django_db(transaction=True)
def test_orbit_checks_dependency_reads_are_index_ranges(graph):
    from django.test.utils import CaptureQueriesContext

    from tasks.invariants import dependency_violations

    with CaptureQueriesContext(connection) as queries:
        assert dependency_violations() == []
    statements = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT")]
    dispatch = [s for s in statements if "`orbit_task`.`queue_id` IN" in s]
    assert dispatch, statements
    for statement in statements:
        plan = explain(statement)
        print("\n" + statement[:120] + "\n" + "\n".join(str(row) for row in plan))
        assert scans(plan, {}) == [], (statement, plan)
    assert explain(dispatch[0])[0]["key"] == "idx_task_dispatch"


@pytest.mark.django_db(transaction=True)
def test_a_prune_of_a_finished_chain_of_5000(graph):
    started = time.monotonic()
    out = prune("--finished-before", "0s")
    took = time.monotonic() - started
    print(f"\nprune of a finished chain of 5,000 tasks (5,000 edges): {took:.2f} s\n{out}")
    assert "removed 5000 tasks" in out and "1 tasks an unfinished task depends on" in out
    assert TaskDependency.objects.count() == 52  # the fan-out's 50 and the join's 2


def test_a_prune_batch_holds_its_applications_row_before_it_deletes(tenant, queue):
    """A submit reads its dependencies' states under the application's row:
    the prune's deletes come under the same row, so a dependent is admitted
    either before (and holds its dependency) or after (and is refused)."""
    from django.test.utils import CaptureQueriesContext

    parent = submit_ok(tenant.client, queue["id"], "parent")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    run_one(tenant, queue["id"])
    run_one(tenant, queue["id"])
    age([parent["id"], child["id"]])
    with CaptureQueriesContext(connection) as queries:
        assert "removed 2 tasks" in prune()
    # the deletes go together, one multi-statement query: each statement in its place
    statements = [sql for q in queries.captured_queries for sql in q["sql"].split("; ")]

    def first(prefix: str) -> int:
        return next(n for n, sql in enumerate(statements) if sql.startswith(prefix))

    locked = next(n for n, sql in enumerate(statements) if "`orbit_application_state`" in sql and "FOR UPDATE" in sql)
    order = [
        locked,
        first("DELETE FROM `orbit_task` "),
        first("DELETE FROM `orbit_attempt`"),
        first("DELETE FROM `orbit_task_dependency`"),
    ]
    assert order == sorted(order), statements
    assert not DependencySettlement.objects.exists() and not TaskDependency.objects.exists()


def test_clean_after_a_blocked_task_misses_its_deadline(tenant, queue):
    from tasks.actions.endings import sweep_deadlines

    parent = submit_ok(tenant.client, queue["id"], "parent")
    late = submit_ok(tenant.client, queue["id"], "late", depends_on=[parent["id"]])
    tail = submit_ok(tenant.client, queue["id"], "tail", depends_on=[late["id"]])
    Task.objects.filter(id=late["id"]).update(deadline_at=timezone.now() - timedelta(seconds=1))
    assert sweep_deadlines() == 1
    assert Task.objects.get(id=late["id"]).state == "FAILED"
    assert Task.objects.get(id=tail["id"]).state == "CANCELLED"  # its CANCEL dependent with it
    assert_clean()
    run_one(tenant, queue["id"])  # the parent settles the failed one's edge: nothing to do
    assert_clean()


def test_clean_through_a_cancel_cascade_past_the_inline_budget(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent", max_attempts=1)
    dependents = fan_out(tenant, queue["id"], parent["id"], INLINE_EDGES + 30)
    grandchildren = [
        submit_ok(tenant.client, queue["id"], f"grandchild-{n}", depends_on=[dependents[-1 - n]])["id"]
        for n in range(3)
    ]
    run_one(tenant, queue["id"], "FAILED")
    assert DependencySettlement.objects.exists()
    assert_clean()  # the cascade half done, its follow-up pending
    run_follow_ups(settle)
    assert Task.objects.filter(id__in=dependents + grandchildren, state="CANCELLED").count() == len(dependents) + 3
    assert not DependencySettlement.objects.exists()
    assert_clean()

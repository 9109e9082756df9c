"""Every verb locks its rows in the one global order, orbit.locking.LOCK_ORDER
(docs/architecture/locking.md): its locking statements (SELECT … FOR UPDATE
[SKIP LOCKED], UPDATE, DELETE, INSERT … ON DUPLICATE KEY UPDATE), as the
MySQL backend sends them, never lock a table's rows for the first time in a
transaction after a row of a later table, and lock no table outside the order.

The tests are transactional: each verb's own transactions commit for real, so
their boundaries are the ones production has."""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from orbit.fields import new_id
from orbit.principal import Actor, authenticate_token, known_credential
from plans.actions import fire_due_plans
from tasks.actions import dispatch, endings, rounds
from tasks.actions.batch import Submission
from tasks.actions.context import WorkerContext
from tasks.actions.dispatch import StartRequest
from tasks.actions.endings import ResultReport
from tasks.actions.identities import register_worker
from tasks.actions.rounds import LeaseRequest, SubmitRequest, run_round
from tasks.models import Attempt, Task
from tests.conftest import Tenant, api_client, post_json
from tests.support.api import assert_ok, make_queue
from tests.support.factories import ALL_SCOPES, make_credential
from tests.support.key_policies import make_key_rows
from tests.support.key_rows import make_policy
from tests.support.lock_order import (
    Lock,
    assert_lock_order,
    classify,
    locking_sequence,
    split_statements,
    transactions,
    violations,
)
from tests.support.plans import plan_body
from tests.support.queues import configure_body
from tests.support.tasks import an_hour_on, cancel, start, submit_ok, task_body, worker_for
from tests.support.tasks import report as report_result

pytestmark = [pytest.mark.mysql_only, pytest.mark.django_db(transaction=True)]

COUNTERS = "orbit_application_state"
KEYS = itertools.count()


def captured():
    return CaptureQueriesContext(connection)


def actor_of(tenant: Tenant) -> Actor:
    return Actor(principal=authenticate_token(tenant.token), request_id=new_id())


def connected(tenant: Tenant, queue_id: str, worker_id: str = "w", keys: bool = True) -> WorkerContext:
    """A worker as its connection knows it after a hello: its identity row and
    its credential, both locked again by the verbs that grant to it."""
    principal = authenticate_token(tenant.token)
    session = new_id()
    identity_id = register_worker(
        principal=principal, worker_id=worker_id, session_id=session, concurrency_keys=keys, queue_ids=[queue_id]
    )
    return replace(
        worker_for(tenant, queue_id, worker_id=worker_id, keys=keys),
        session_id=session,
        identity_id=identity_id,
        credential=known_credential(tenant.token),
    )


def submission(queue_id: str, key: str, **overrides) -> Submission:
    return Submission(key=key, body=task_body(queue_id, **overrides), request_id=new_id())


def leased(tenant: Tenant, queue_id: str, count: int = 1, **submitted) -> tuple:
    for _ in range(count):
        n = next(KEYS)
        submit_ok(tenant.client, queue_id, f"leased-{n}", **{k: f"{v}/{n}" for k, v in submitted.items()})
    worker = connected(tenant, queue_id, worker_id=f"w-{next(KEYS)}")
    assignments = rounds.lease_tasks(worker=worker, limit=count)
    assert len(assignments) == count
    return worker, assignments


def started(tenant: Tenant, queue_id: str, count: int = 1, **submitted) -> tuple:
    worker, assignments = leased(tenant, queue_id, count, **submitted)
    for entry in assignments:
        rounds.approve_start(worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"])
    return worker, assignments


def report(worker, entry, outcome: str = "SUCCEEDED") -> ResultReport:
    return ResultReport(worker, entry["attempt_id"], entry["epoch"], outcome, False, {"ok": 1}, None)


# The checker itself.


def test_statements_are_split_only_outside_quotes():
    sql = "SET autocommit=0; UPDATE `a` SET x = 'semi;colon\\';' , y = \"q;\" WHERE id = 'it''s;'; COMMIT"
    assert split_statements(sql) == ["SET autocommit=0", "UPDATE `a` SET x = '?' , y = \"\" WHERE id = '?'", "COMMIT"]


def test_each_locking_statement_names_its_table_and_kind():
    def locks(statement: str) -> list[tuple[str, str]]:
        return [(lock.table, lock.kind) for lock in classify(statement) if isinstance(lock, Lock)]

    assert locks("SELECT `id` FROM `orbit_task` WHERE `id` IN (%s) ORDER BY `id` FOR UPDATE SKIP LOCKED") == [
        ("orbit_task", "FOR UPDATE SKIP LOCKED")
    ]
    assert locks("SELECT a FROM orbit_plan INNER JOIN `orbit_queue` ON (x) WHERE y FOR UPDATE") == [
        ("orbit_plan", "FOR UPDATE"),
        ("orbit_queue", "FOR UPDATE"),
    ]
    subquery = (
        "SELECT a FROM `orbit_task` WHERE NOT EXISTS (SELECT 1 FROM `orbit_concurrency_key` k WHERE (x)) FOR UPDATE"
    )
    assert locks(subquery) == [("orbit_task", "FOR UPDATE")]  # a subquery's rows are read, not locked
    assert locks("UPDATE `orbit_attempt` SET `state` = '?' WHERE `id` IN ('?')") == [("orbit_attempt", "UPDATE")]
    assert locks("INSERT INTO orbit_event_sequence (a) VALUES (1) ON DUPLICATE KEY UPDATE a = 2") == [
        ("orbit_event_sequence", "UPSERT")
    ]
    assert locks("INSERT INTO `orbit_task` (`id`) VALUES ('?')") == []  # a plain insert: before any lock
    assert locks("SELECT `id` FROM `orbit_task` WHERE `id` = '?'") == []


def test_a_table_first_locked_after_a_later_one_is_a_violation_a_relock_is_not():
    sequence = [
        entry
        for statement in (
            "SET autocommit=0",
            "SELECT a FROM orbit_application_state WHERE x FOR UPDATE",
            "SELECT a FROM orbit_task WHERE x FOR UPDATE",
            "UPDATE orbit_application_state SET a = 1",  # held since the start: fine
            "SELECT a FROM orbit_concurrency_key WHERE x FOR UPDATE",  # first locked after a task: not fine
            "UPDATE orbit_idempotency_record SET a = 1",
            "COMMIT",
            "SELECT a FROM orbit_concurrency_key WHERE x FOR UPDATE",  # another transaction
        )
        for entry in classify(statement)
    ]
    first, second = transactions(sequence)
    assert violations(first) == [
        "orbit_concurrency_key first locked after orbit_task",
        "orbit_idempotency_record is not in LOCK_ORDER (UPDATE)",
    ]
    assert violations(second) == []


def test_a_skip_locked_read_may_come_anywhere():
    sequence = [
        entry
        for statement in (
            "SET autocommit=0",
            "SELECT a FROM orbit_application_state WHERE x FOR UPDATE",
            "SELECT a FROM orbit_task WHERE x FOR UPDATE SKIP LOCKED",  # waits for nothing
            "SELECT a FROM orbit_concurrency_key WHERE x FOR UPDATE",
            "SELECT a FROM orbit_queue_state WHERE x FOR UPDATE SKIP LOCKED",
            "COMMIT",
        )
        for entry in classify(statement)
    ]
    (locks,) = transactions(sequence)
    assert violations(locks) == []


def test_updates_of_rows_the_transaction_inserted_wait_for_nothing():
    def checked(*sqls: str) -> list[list[str]]:
        return [violations(entries) for entries in transactions(locking_sequence([{"sql": sql} for sql in sqls]))]

    inserted = (
        "SET autocommit=0; INSERT INTO `orbit_task` (`id`, `payload`) "
        r"""VALUES ('t1', '{\"a\": \"(x, y);\"}'), ('t2', 'z')"""
    )
    record = "INSERT INTO `orbit_idempotency_record` (`namespace_id`, `key`) VALUES ('n', 'k;')"
    counters = "SELECT a FROM `orbit_application_state` WHERE x FOR UPDATE"
    keys = "SELECT a FROM `orbit_concurrency_key` WHERE x FOR UPDATE"
    assert checked(
        inserted,
        record,
        counters,
        "UPDATE `orbit_task` SET `key_ready` = 1 WHERE `id` IN ('t2', 't1')",  # its own new rows
        keys,
        "UPDATE `orbit_idempotency_record` SET `response_status` = 201 WHERE `orbit_idempotency_record`.`id` = 7",
        "COMMIT",
    ) == [[]]
    assert checked(
        inserted,
        counters,
        "UPDATE `orbit_task` SET `key_ready` = 1 WHERE `id` IN ('t1', 't3')",  # t3 is not its own
        keys,
        "UPDATE `orbit_idempotency_record` SET `response_status` = 201 WHERE `id` = 7",  # inserted nothing there
        "COMMIT",
    ) == [
        [
            "orbit_concurrency_key first locked after orbit_task",
            "orbit_idempotency_record is not in LOCK_ORDER (UPDATE)",
        ]
    ]


# The verbs, each driven for real.


def test_a_submit_round(tenant):
    queue = make_queue(tenant.client, "submit")
    with captured() as queries:
        receipt = rounds.submit_task(SubmitRequest(actor_of(tenant), submission(queue["id"], "s-1")))
    assert receipt.status == 201
    assert_lock_order(queries, expect=[COUNTERS, "orbit_queue_state", "orbit_event_sequence"])


def test_a_keyed_submit_round(tenant):
    queue = make_queue(tenant.client, "submit-keyed")
    with captured() as queries:
        request = SubmitRequest(actor_of(tenant), submission(queue["id"], "s-1", concurrency_key="ledger/1"))
        assert rounds.submit_task(request).status == 201
    assert_lock_order(queries, expect=[COUNTERS, "orbit_queue_state"])


def test_a_batch_submit(tenant):
    queue = make_queue(tenant.client, "batch")
    other = make_queue(tenant.client, "batch-other")
    items = [
        {"idempotency_key": f"b-{n}", "task": task_body(q["id"], **({"concurrency_key": "k/1"} if n % 2 else {}))}
        for n, q in enumerate([queue, other, queue, other])
    ]
    with captured() as queries:
        response = post_json(tenant.client, "/v1/tasks:batch", {"tasks": items})
    assert response.status_code == 200, response.content
    assert_lock_order(queries, expect=[COUNTERS, "orbit_queue_state"])


@pytest.mark.parametrize("limit", [1, 16])
def test_a_lease(tenant, limit):
    queue = make_queue(tenant.client, "lease", max_concurrency=32, rate_per_second=1000)
    for n in range(limit):
        submit_ok(tenant.client, queue["id"], f"l-{n}")
    worker = connected(tenant, queue["id"])
    with captured() as queries:
        assert len(rounds.lease_tasks(worker=worker, limit=limit)) == limit
    expected = [COUNTERS, "orbit_queue_state", "orbit_worker_identity", "orbit_credential", "orbit_task"]
    assert_lock_order(queries, expect=[*expected, "orbit_event_sequence"])


def test_a_keyed_lease(tenant):
    queue = make_queue(tenant.client, "lease-keyed", max_concurrency=32, rate_per_second=1000)
    for n in range(4):
        submit_ok(tenant.client, queue["id"], f"k-{n}", concurrency_key=f"object/{n % 2}")
    worker = connected(tenant, queue["id"], keys=True)
    with captured() as queries:
        assert len(rounds.lease_tasks(worker=worker, limit=4)) == 2
    assert_lock_order(queries, expect=[COUNTERS, "orbit_worker_identity", "orbit_concurrency_key", "orbit_task"])


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_a_start(tenant, keyed):
    queue = make_queue(tenant.client, "start", rate_per_second=1000)
    worker, (entry,) = leased(tenant, queue["id"], **({"concurrency_key": "object"} if keyed else {}))
    with captured() as queries:
        rounds.approve_start(worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"])
    assert_lock_order(queries, expect=["orbit_queue_state", "orbit_credential", "orbit_attempt"])


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_a_result(tenant, keyed):
    queue = make_queue(tenant.client, "result", rate_per_second=1000)
    worker, (entry,) = started(tenant, queue["id"], **({"concurrency_key": "object"} if keyed else {}))
    with captured() as queries:
        answer = rounds.record_result(
            worker=worker,
            attempt_id=entry["attempt_id"],
            epoch=entry["epoch"],
            outcome="SUCCEEDED",
            retryable=False,
            output={"ok": 1},
            error=None,
        )
    assert answer["task_state"] == "SUCCEEDED"
    expected = [
        COUNTERS,
        "orbit_queue_state",
        "orbit_credential",
        "orbit_task",
        "orbit_attempt",
        "orbit_event_sequence",
    ]
    assert_lock_order(queries, expect=expected + (["orbit_concurrency_key"] if keyed else []))


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_a_round_of_results_starts_leases_and_submits(tenant, keyed):
    queue = make_queue(tenant.client, "mixed", max_concurrency=32, rate_per_second=1000)
    key = {"concurrency_key": "object"} if keyed else {}
    worker, running = started(tenant, queue["id"], 2, **key)
    waiter, waiting = leased(tenant, queue["id"], 1, **key)
    for n in range(3):
        submit_ok(tenant.client, queue["id"], f"later-{n}", **({"concurrency_key": f"other/{n}"} if keyed else {}))
    other = connected(tenant, queue["id"], worker_id="other")
    items = [
        report(worker, running[0]),
        report(worker, running[1], outcome="FAILED"),
        StartRequest(waiter, waiting[0]["attempt_id"], waiting[0]["epoch"]),
        LeaseRequest(other, 16),
        SubmitRequest(actor_of(tenant), submission(queue["id"], "in-round", **key)),
    ]
    with captured() as queries:
        answers = run_round(items)
    assert not [answer for answer in answers if isinstance(answer, BaseException)], answers
    expected = [
        COUNTERS,
        "orbit_queue_state",
        "orbit_worker_identity",
        "orbit_credential",
        "orbit_task",
        "orbit_attempt",
    ]
    assert_lock_order(queries, expect=expected)


def test_a_renew(tenant):
    queue = make_queue(tenant.client, "renew", rate_per_second=1000)
    worker, (entry,) = started(tenant, queue["id"])
    with captured() as queries:
        dispatch.renew_lease(worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"])
    assert_lock_order(queries, expect=["orbit_credential", "orbit_attempt"])


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_a_release(tenant, keyed):
    queue = make_queue(tenant.client, "release")
    worker, (entry,) = leased(tenant, queue["id"], **({"concurrency_key": "object"} if keyed else {}))
    with captured() as queries:
        endings.release_attempt(worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"], reason="busy")
    assert_lock_order(queries, expect=[COUNTERS, "orbit_task", "orbit_attempt"])


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_a_connection_handing_back_what_it_never_acknowledged(tenant, keyed):
    # The take-back of a Start sent ahead also locks the worker identity (its session).
    queue = make_queue(tenant.client, "take-back")
    worker, (entry,) = leased(tenant, queue["id"], **({"concurrency_key": "object"} if keyed else {}))
    assert worker.identity_id is not None
    with captured() as queries:
        endings.release_attempt(
            worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"], reason="closed", undelivered_start=True
        )
    expected = [COUNTERS, "orbit_worker_identity", "orbit_task", "orbit_attempt"]
    assert_lock_order(queries, expect=[*expected, *(["orbit_concurrency_key"] if keyed else [])])


@pytest.mark.parametrize("state", ["waiting", "leased", "running"])
def test_a_cancel(tenant, state):
    queue = make_queue(tenant.client, "cancel", rate_per_second=1000)
    if state == "waiting":
        task_id = submit_ok(tenant.client, queue["id"], "c-1", concurrency_key="object")["id"]
    else:
        _, (entry,) = (started if state == "running" else leased)(tenant, queue["id"], concurrency_key="object")
        task_id = entry["task"]["id"]
    with captured() as queries:
        assert_ok(cancel(tenant.client, task_id, key="cancel-1"))
    assert_lock_order(queries, expect=["orbit_task"])


def test_a_resolve(tenant):
    queue = make_queue(tenant.client, "resolve", rate_per_second=1000)
    worker, (entry,) = started(tenant, queue["id"], concurrency_key="object")
    rounds.record_result(
        worker=worker,
        attempt_id=entry["attempt_id"],
        epoch=entry["epoch"],
        outcome="UNKNOWN",
        retryable=False,
        output=None,
        error={"code": "timeout"},
    )
    body = {"resolution": "RETRY", "reason": "checked the ledger"}
    with captured() as queries:
        assert_ok(post_json(tenant.client, f"/v1/tasks/{entry['task']['id']}:resolve", body, key="resolve-1"))
    assert_lock_order(queries, expect=[COUNTERS, "orbit_task"])


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_a_lease_recovery(tenant, keyed):
    queue = make_queue(tenant.client, "recover", rate_per_second=1000)
    _, entries = started(tenant, queue["id"], 2, **({"concurrency_key": "object"} if keyed else {}))
    Attempt.objects.filter(id__in=[e["attempt_id"] for e in entries]).update(
        lease_expires_at=timezone.now() + timedelta(minutes=1)
    )
    with an_hour_on(), captured() as queries:
        assert endings.recover_expired_leases() == 2
    assert_lock_order(queries, expect=[COUNTERS, "orbit_task", "orbit_attempt"])


@pytest.mark.parametrize("state", ["waiting", "leased"])
def test_a_deadline_failure(tenant, state):
    queue = make_queue(tenant.client, "deadline")
    if state == "waiting":
        task_id = submit_ok(tenant.client, queue["id"], "d-1", concurrency_key="object")["id"]
    else:
        _, (entry,) = leased(tenant, queue["id"], concurrency_key="object")
        task_id = entry["task"]["id"]
    Task.objects.filter(id=task_id).update(deadline_at=timezone.now() + timedelta(minutes=1))
    with an_hour_on(), captured() as queries:
        assert endings.fail_for_deadline(task_id) is True
    assert_lock_order(queries, expect=[COUNTERS, "orbit_task"])


def test_a_queue_configure_and_retire(tenant):
    queue = make_queue(tenant.client, "configured")
    with captured() as configuring:
        body = configure_body(max_concurrency=4, paused=True)  # a queue is paused before it retires
        assert_ok(post_json(tenant.client, f"/v1/queues/{queue['id']}:configure", body, key="configure-1"))
    assert_lock_order(configuring, expect=["orbit_queue"])
    with captured() as retiring:
        body = {"expected_revision": "2", "reason": "done"}
        assert_ok(post_json(tenant.client, f"/v1/queues/{queue['id']}:retire", body, key="retire-1"))
    assert_lock_order(retiring, expect=["orbit_queue"])


def test_an_application_configure(tenant):
    issued = make_credential(tenant.namespace, scopes=[*ALL_SCOPES, "applications:manage"])
    client = api_client(issued.token)
    application_id = tenant.namespace.application_id
    body = {"expected_revision": "1", "reason": "cap", "max_active_attempts": 3, "max_unfinished_tasks": 2}
    with captured() as queries:
        assert_ok(post_json(client, f"/v1/applications/{application_id}:configure", body, key="app-1"))
    assert_lock_order(queries, expect=["orbit_application"])


def test_a_plan_create_and_a_trigger_step(tenant):
    issued = make_credential(tenant.namespace, scopes=[*ALL_SCOPES, "plans:manage"])
    client = api_client(issued.token)
    queue = make_queue(tenant.client, "planned", rate_per_second=1000)
    with captured() as creating:
        assert_ok(post_json(client, "/v1/plans", plan_body(queue["id"]), key="plan-1"), 201)
    assert_lock_order(creating, expect=["orbit_event_sequence"])
    with captured() as stepping:
        assert fire_due_plans(timezone.now() + timedelta(seconds=61)) == 1  # its first point is due
    assert_lock_order(stepping, expect=["orbit_plan", COUNTERS, "orbit_queue_state"])


def test_a_hello_registers_its_worker(tenant):
    queue = make_queue(tenant.client, "hello")
    principal = authenticate_token(tenant.token)
    for session in ("first", "second"):  # a new identity, then a takeover of it
        with captured() as queries:
            register_worker(
                principal=principal, worker_id="w-1", session_id=session, concurrency_keys=True, queue_ids=[queue["id"]]
            )
        assert assert_lock_order(queries, expect=["orbit_worker_identity"]) == [["orbit_worker_identity"]]  # alone


def test_a_key_policy_create_configure_and_retire(tenant):
    key_rows = [f"customer/{n}" for n in range(3)]
    make_key_rows(tenant.namespace_id, key_rows)
    body = {"match": {"prefix": "customer/"}, "capacity": 2, "reason": "shared"}
    with captured() as creating:
        policy = assert_ok(post_json(tenant.client, "/v1/key-policies", body, key="policy-1"), 201)["policy"]
    # the insert, then the generation; then the reconcile's own transaction of
    # key rows, behind their application's state row as every key row is locked
    reconcile = ["orbit_application_state", "orbit_concurrency_key"]
    assert assert_lock_order(creating, expect=["orbit_application", "orbit_event_sequence", *reconcile])
    with captured() as configuring:
        body = {"expected_revision": "1", "reason": "more", "capacity": 3}
        assert_ok(post_json(tenant.client, f"/v1/key-policies/{policy['id']}:configure", body, key="policy-2"))
    change = ["orbit_key_policy", "orbit_application", "orbit_idempotency_record", "orbit_event_sequence"]
    # the change; its reconcile's chunk; the applied revision, a statement of its own
    assert assert_lock_order(configuring) == [change, reconcile, ["orbit_key_policy"]]
    with captured() as retiring:
        body = {"expected_revision": "2", "reason": "done"}
        assert_ok(post_json(tenant.client, f"/v1/key-policies/{policy['id']}:retire", body, key="policy-3"))
    assert_lock_order(retiring, expect=["orbit_key_policy", "orbit_application", *reconcile])


def test_a_lease_and_ending_on_a_slotted_key(tenant):
    # given a key with capacity 3 whose slots 0 and 1 are taken: the next grant is slot 2
    make_policy(tenant.namespace, key="slotted", capacity=3)
    queue = make_queue(tenant.client, "slotted", rate_per_second=1000)
    for n in range(4):
        submit_ok(tenant.client, queue["id"], f"slotted-{n}", concurrency_key="slotted")
    worker = worker_for(tenant, queue["id"])
    first = rounds.lease_tasks(worker=worker, limit=2)
    with captured() as leasing:
        (third,) = rounds.lease_tasks(worker=worker, limit=1)
    assert third["concurrency_slot"] == 2
    assert_lock_order(leasing, expect=[COUNTERS, "orbit_concurrency_key", "orbit_concurrency_slot"])
    lease = {"worker": worker, **third}
    start(lease)
    with captured() as ending:
        report_result(lease, "SUCCEEDED")
    assert_lock_order(ending, expect=["orbit_concurrency_key", "orbit_concurrency_slot", "orbit_attempt"])
    assert len(first) == 2

"""Design figures (docs/architecture/design-figures.md): the exact number of
round trips to MySQL each hot verb takes, pinned. A change that adds (or
saves) a round trip in a submit round, a lease, a Start or a result fails
here, and updates the figure and its reason on that page.

A round trip is one query the connection sends: a multi-statement query of
the row layer or the MySQL backend counts once. Django logs two entries that
send nothing on this backend, and they are not counted: BEGIN (the backend
sends its autocommit change with the next statement, orbit.db.mysql) and a
COMMIT that rode on the transaction's last writes (orbit.db.rows
.atomic_sent_together); a COMMIT sent on its own counts.

Each verb runs as production runs it: its transaction is real (the test is
transactional), its worker is a connected one (an identity row and a
credential, as after a hello), its submitter's credential is known to the
process, and one verb of the same kind ran before the measured one."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from orbit.fields import new_id
from orbit.principal import Actor, authenticate_token, known_credential
from tasks.actions import rounds
from tasks.actions.batch import Submission
from tasks.actions.context import WorkerContext
from tasks.actions.endings import ResultReport
from tasks.actions.identities import register_worker
from tasks.actions.rounds import LeaseRequest, SubmitRequest
from tasks.models import Task
from tests.conftest import Tenant
from tests.support.api import make_queue
from tests.support.lock_order import split_statements
from tests.support.tasks import submit_ok, task_body, worker_for

pytestmark = [pytest.mark.mysql_only, pytest.mark.django_db(transaction=True)]

# The figures, as docs/architecture/design-figures.md lists them.
FIGURES = {
    "a submit round of 1": 3,
    "a lease of 1": 4,
    "a lease of 16": 4,
    "a keyed lease of 1": 9,
    "a keyed lease of 16": 9,
    "a keyed lease of 16, each key with a waiting sibling": 8,
    "a start": 3,
    "a keyed start": 3,
    "a result": 3,
    "a keyed result": 3,
    "a keyed result with its hand-off": 5,
    "a keyed result with its hand-off, started ahead": 5,
}

SEQUENCE = itertools.count()


def round_trips(captured: CaptureQueriesContext) -> int:
    """The queries sent: every captured query but BEGIN (nothing is sent) and
    a COMMIT whose statement already went with the last writes."""
    count, commit_rode = 0, False
    for query in captured.captured_queries:
        sql = query["sql"]
        if sql == "BEGIN":
            continue
        if sql == "COMMIT":
            count += 0 if commit_rode else 1
            commit_rode = False
            continue
        count += 1
        commit_rode = split_statements(sql)[-1].upper() == "COMMIT"
    return count


def measured(verb: Callable[[], Any]) -> tuple[int, Any]:
    with CaptureQueriesContext(connection) as captured:
        result = verb()
    return round_trips(captured), result


def connected(tenant: Tenant, queue_id: str) -> WorkerContext:
    principal = authenticate_token(tenant.token)
    session, worker_id = new_id(), f"w-{next(SEQUENCE)}"
    identity_id = register_worker(
        principal=principal, worker_id=worker_id, session_id=session, concurrency_keys=True, queue_ids=[queue_id]
    )
    return replace(
        worker_for(tenant, queue_id, worker_id=worker_id),
        session_id=session,
        identity_id=identity_id,
        credential=known_credential(tenant.token),
    )


def submit_request(tenant: Tenant, queue_id: str) -> SubmitRequest:
    actor = Actor(principal=authenticate_token(tenant.token), request_id=new_id())
    submission = Submission(key=f"s-{next(SEQUENCE)}", body=task_body(queue_id), request_id=new_id())
    return SubmitRequest(actor, submission, credential_to_confirm=known_credential(tenant.token))


def queue_with(tenant: Tenant, tasks: int, *, keyed: bool = False, per_key: int = 1) -> dict[str, Any]:
    queue = make_queue(tenant.client, f"figures-{next(SEQUENCE)}", max_concurrency=64, rate_per_second=1000)
    for n in range(tasks):
        for sibling in range(per_key):
            key = {"concurrency_key": f"object/{n}"} if keyed else {}
            submit_ok(tenant.client, queue["id"], f"t-{n}-{sibling}", **key)
    return queue


def test_a_submit_round_of_one(tenant):
    queue = queue_with(tenant, 0)
    rounds.submit_task(submit_request(tenant, queue["id"]))
    request = submit_request(tenant, queue["id"])

    trips, receipt = measured(lambda: rounds.submit_task(request))

    assert receipt.status == 201
    assert trips == FIGURES["a submit round of 1"]


@pytest.mark.parametrize("limit", [1, 16])
def test_a_lease(tenant, limit):
    queue = queue_with(tenant, 1 + limit)
    worker = connected(tenant, queue["id"])
    assert len(rounds.lease_tasks(worker=worker, limit=1)) == 1

    trips, leased = measured(lambda: rounds.lease_tasks(worker=worker, limit=limit))

    assert len(leased) == limit
    assert trips == FIGURES[f"a lease of {limit}"]


@pytest.mark.parametrize("limit", [1, 16])
def test_a_keyed_lease(tenant, limit):
    """Tasks of distinct keys, none leased before: the key rows are made (an
    insert and a read again), the overtaking siblings of all candidates are
    read in one round trip and the ready roles handed on in another, however
    many keys the lease takes. (Submitted after the warming lease: its scan
    reads one row past its share, whose key row it makes.)"""
    queue = queue_with(tenant, 1, keyed=True)
    worker = connected(tenant, queue["id"])
    assert len(rounds.lease_tasks(worker=worker, limit=1)) == 1
    for n in range(limit):
        submit_ok(tenant.client, queue["id"], f"fresh-{n}", concurrency_key=f"object/fresh-{n}")

    trips, leased = measured(lambda: rounds.lease_tasks(worker=worker, limit=limit))

    assert len(leased) == limit and all("concurrency_token" in entry for entry in leased)
    assert trips == FIGURES[f"a keyed lease of {limit}"]


def test_a_keyed_lease_of_keys_with_waiting_siblings(tenant):
    """Each key's ready task has a sibling waiting behind it: the read of the
    overtaking siblings finds it, and it is made ready when the lease takes
    its key's task, without the round trip of the hand-on reads."""
    queue = queue_with(tenant, 1 + 16, keyed=True, per_key=2)
    worker = connected(tenant, queue["id"])
    assert len(rounds.lease_tasks(worker=worker, limit=1)) == 1

    trips, leased = measured(lambda: rounds.lease_tasks(worker=worker, limit=16))

    assert len(leased) == 16 and len({entry["task"]["concurrency_key"] for entry in leased}) == 16
    assert trips == FIGURES["a keyed lease of 16, each key with a waiting sibling"]
    # every key, the one leased before included, has its sibling ready now
    ready = Task.objects.filter(queue_id=queue["id"], state="WAITING", key_ready=True)
    assert sorted(ready.values_list("concurrency_key", flat=True)) == sorted(f"object/{n}" for n in range(17))


def leased_pair(tenant: Tenant, *, keyed: bool) -> tuple[WorkerContext, list[dict[str, Any]]]:
    queue = queue_with(tenant, 2, keyed=keyed)
    worker = connected(tenant, queue["id"])
    leased = rounds.lease_tasks(worker=worker, limit=2)
    assert len(leased) == 2
    return worker, leased


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_a_start(tenant, keyed):
    worker, (first, second) = leased_pair(tenant, keyed=keyed)
    rounds.approve_start(worker=worker, attempt_id=first["attempt_id"], epoch=first["epoch"])

    trips, started = measured(
        lambda: rounds.approve_start(worker=worker, attempt_id=second["attempt_id"], epoch=second["epoch"])
    )

    assert started["attempt_number"] == 1
    assert trips == FIGURES["a keyed start" if keyed else "a start"]


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_a_result(tenant, keyed):
    worker, leased = leased_pair(tenant, keyed=keyed)
    for entry in leased:
        rounds.approve_start(worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"])

    def result(entry: dict[str, Any]) -> dict[str, Any]:
        return rounds.record_result(
            worker=worker,
            attempt_id=entry["attempt_id"],
            epoch=entry["epoch"],
            outcome="SUCCEEDED",
            retryable=False,
            output={"ok": 1},
            error=None,
        )

    result(leased[0])
    trips, answer = measured(lambda: result(leased[1]))

    assert answer["task_state"] == "SUCCEEDED" and answer["duplicate"] is False
    assert trips == FIGURES["a keyed result" if keyed else "a result"]


@pytest.mark.parametrize("ahead", [False, True], ids=["started-by-worker", "started-ahead"])
def test_a_keyed_result_with_its_hand_off(tenant, ahead):
    """The round of a keyed result and the lease of one task for the slot it
    frees (workers.consumers: the hand-off), its key's next task waiting: the
    result's 3 less its writes' own trip, the lease's candidates, and one read
    of the next in line; the lease finds the key row the result locked and
    sends nothing for it. With the result's Start sent ahead (start_next), the
    lease decides the Start of what it takes on the counter rows the round
    holds, with no statement of its own."""
    queue = queue_with(tenant, 2, keyed=True, per_key=3)
    worker = connected(tenant, queue["id"])
    leased = rounds.lease_tasks(worker=worker, limit=2)
    for entry in leased:
        rounds.approve_start(worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"])

    def result_and_lease(entry: dict[str, Any]) -> list[Any]:
        report = ResultReport(worker, entry["attempt_id"], entry["epoch"], "SUCCEEDED", False, None, None)
        return rounds.run_round(
            [report, LeaseRequest(worker, 1, after=report, start_ahead=("echo", "v1") if ahead else None)]
        )

    result_and_lease(leased[0])
    trips, (answer, outcome) = measured(lambda: result_and_lease(leased[1]))

    assert answer["task_state"] == "SUCCEEDED"
    (handed,) = outcome.assignments
    assert handed["task"]["concurrency_key"] == leased[1]["task"]["concurrency_key"]
    assert handed["concurrency_token"] > leased[1]["concurrency_token"]
    assert handed.get("state") == ("RUNNING" if ahead else None)
    assert Task.objects.get(id=handed["task"]["id"]).state == ("RUNNING" if ahead else "LEASED")
    figure = "a keyed result with its hand-off, started ahead" if ahead else "a keyed result with its hand-off"
    assert trips == FIGURES[figure]


def test_a_commit_sent_on_its_own_counts_and_one_that_rode_does_not():
    class Captured:
        captured_queries = [
            {"sql": "BEGIN"},
            {"sql": "SET autocommit=0; SELECT a FROM t FOR UPDATE"},
            {"sql": "UPDATE t SET a = 'x;'; COMMIT"},
            {"sql": "COMMIT"},  # rode on the writes
            {"sql": "BEGIN"},
            {"sql": "SET autocommit=0; UPDATE t SET a = 1"},
            {"sql": "COMMIT"},  # sent
        ]

    assert round_trips(Captured()) == 4  # type: ignore[arg-type]

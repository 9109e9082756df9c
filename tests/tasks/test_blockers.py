"""GET /v1/tasks/{id}/blockers: each reason built for real, and the next lease agreeing with it.

For every situation the answer names the reason with its facts, and a lease
by a worker that would otherwise take the task takes nothing; once the
reason is gone, the answer is empty and the lease takes the task."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from orbit.models import Application
from orbit.timefmt import format_time
from queues.models import Queue
from tasks.actions import rounds
from tasks.actions.blockers import MESSAGES
from tasks.models import Attempt, ConcurrencyKey, WorkerIdentity
from tests.conftest import api_client
from tests.support.api import assert_error, assert_ok, make_queue
from tests.support.factories import ALL_SCOPES, make_credential
from tests.support.tasks import configure_queue, in_seconds, submit_ok, worker_for

pytestmark = pytest.mark.django_db


def blockers(tenant, task_id: str) -> dict:
    return assert_ok(tenant.client.get(f"/v1/tasks/{task_id}/blockers"))


def codes(tenant, task_id: str) -> list[str]:
    return [item["code"] for item in blockers(tenant, task_id)["items"]]


def connected(tenant, queue_id: str, *, handlers: list[list[str]] | None = None, keys: bool = True) -> None:
    """A worker identity whose session is live (as a connection's heartbeat keeps it)."""
    WorkerIdentity.objects.create(
        namespace_id=tenant.namespace_id,
        worker_id=f"w-{WorkerIdentity.objects.count()}",
        concurrency_keys=keys,
        credential_id="0" * 32,
        session_id="1" * 32,
        connected_at=timezone.now(),
        seen_at=timezone.now(),
        queue_ids=[queue_id],
        handlers=handlers or [],
    )


def leased_ids(tenant, queue_id: str, **worker) -> list[str]:
    return [a["task"]["id"] for a in rounds.lease_tasks(worker=worker_for(tenant, queue_id, **worker), limit=16)]


def test_a_task_a_lease_would_take_has_no_blocker(tenant):
    queue = make_queue(tenant.client, "free")
    connected(tenant, queue["id"])
    task = submit_ok(tenant.client, queue["id"], "t")
    assert blockers(tenant, task["id"]) == {"state": "WAITING", "items": []}
    assert leased_ids(tenant, queue["id"]) == [task["id"]]
    assert blockers(tenant, task["id"]) == {"state": "LEASED", "items": []}


def test_not_yet_available(tenant):
    queue = make_queue(tenant.client, "later")
    connected(tenant, queue["id"])
    available_at = in_seconds(3600)
    task = submit_ok(tenant.client, queue["id"], "t", available_at=available_at)
    (item,) = blockers(tenant, task["id"])["items"]
    assert item["code"] == "NOT_YET_AVAILABLE" and item["until"] == available_at
    assert leased_ids(tenant, queue["id"]) == []


def test_queue_paused_and_retired(tenant):
    queue = make_queue(tenant.client, "paused")
    connected(tenant, queue["id"])
    task = submit_ok(tenant.client, queue["id"], "t")
    configure_queue(tenant.client, queue["id"], paused=True)
    assert codes(tenant, task["id"]) == ["QUEUE_PAUSED"]
    assert leased_ids(tenant, queue["id"]) == []
    # A retired queue holds no unfinished task through the API (retire needs it
    # empty); the row is marked here to show the lease's predicate answers it.
    Queue.objects.filter(id=queue["id"]).update(retired_at=timezone.now())
    assert codes(tenant, task["id"]) == ["QUEUE_RETIRED"]
    assert leased_ids(tenant, queue["id"]) == []


def test_queue_at_max_concurrency(tenant):
    queue = make_queue(tenant.client, "one-at-a-time", max_concurrency=1)
    connected(tenant, queue["id"])
    first = submit_ok(tenant.client, queue["id"], "a")
    second = submit_ok(tenant.client, queue["id"], "b")
    assert leased_ids(tenant, queue["id"]) == [first["id"]]
    (item,) = blockers(tenant, second["id"])["items"]
    assert item == {
        "code": "QUEUE_AT_MAX_CONCURRENCY",
        "message": "every permit of the queue's max_concurrency is held",
        "active_permits": 1,
        "max_concurrency": 1,
    }
    assert leased_ids(tenant, queue["id"]) == []


def test_start_window_full(tenant):
    queue = make_queue(tenant.client, "slow-starts", rate_per_second=1)
    connected(tenant, queue["id"])
    first = submit_ok(tenant.client, queue["id"], "a")
    second = submit_ok(tenant.client, queue["id"], "b")
    (assign,) = rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=16)
    assert assign["task"]["id"] == first["id"]
    # the lease reserved the window's only start
    (reserved,) = blockers(tenant, second["id"])["items"]
    assert reserved["code"] == "START_WINDOW_FULL" and reserved["reserved_starts"] == 1
    assert leased_ids(tenant, queue["id"]) == []
    rounds.approve_start(worker=worker_for(tenant, queue["id"]), attempt_id=assign["attempt_id"], epoch=1)
    (full,) = blockers(tenant, second["id"])["items"]
    assert full["code"] == "START_WINDOW_FULL" and full["window_count"] == 1 and "until" in full
    assert leased_ids(tenant, queue["id"]) == []


def test_application_quota_full(tenant):
    queue = make_queue(tenant.client, "quota")
    connected(tenant, queue["id"])
    Application.objects.filter(id=tenant.namespace.application_id).update(max_active_attempts=1)
    first = submit_ok(tenant.client, queue["id"], "a")
    second = submit_ok(tenant.client, queue["id"], "b")
    assert leased_ids(tenant, queue["id"]) == [first["id"]]
    # the counters are the application's: read with applications:manage (see the tests below)
    manager = api_client(make_credential(tenant.namespace, scopes=[*ALL_SCOPES, "applications:manage"]).token)
    (item,) = assert_ok(manager.get(f"/v1/tasks/{second['id']}/blockers"))["items"]
    assert item["code"] == "APPLICATION_QUOTA_FULL"
    assert (item["active_attempts"], item["max_active_attempts"]) == (1, 1)
    assert leased_ids(tenant, queue["id"]) == []


def test_key_held_names_the_holder(tenant):
    here, there = make_queue(tenant.client, "here"), make_queue(tenant.client, "there")
    connected(tenant, here["id"])
    connected(tenant, there["id"])
    holder = submit_ok(tenant.client, here["id"], "a", concurrency_key="invoice/7")
    waiting = submit_ok(tenant.client, there["id"], "b", concurrency_key="invoice/7")
    (assign,) = rounds.lease_tasks(worker=worker_for(tenant, here["id"], worker_id="w-holder"), limit=16)
    (item,) = blockers(tenant, waiting["id"])["items"]
    assert item["code"] == "KEY_HELD"
    assert (item["attempt_id"], item["task_id"], item["worker_id"]) == (assign["attempt_id"], holder["id"], "w-holder")
    assert item["since"] == format_time(Attempt.objects.get(id=assign["attempt_id"]).leased_at)
    assert leased_ids(tenant, there["id"]) == []


def test_the_key_turn_of_another_task(tenant):
    queue = make_queue(tenant.client, "turns")
    connected(tenant, queue["id"])
    first = submit_ok(tenant.client, queue["id"], "a", concurrency_key="k")
    second = submit_ok(tenant.client, queue["id"], "b", concurrency_key="k")
    (item,) = blockers(tenant, second["id"])["items"]
    assert item["code"] == "KEY_TURN_OF_ANOTHER_TASK" and item["task_id"] == first["id"]
    assert leased_ids(tenant, queue["id"]) == [first["id"]]


@pytest.mark.mysql_only  # SQLite's integers cannot hold the uint64 token space's end
def test_key_tokens_exhausted(tenant):
    queue = make_queue(tenant.client, "spent")
    connected(tenant, queue["id"])
    task = submit_ok(tenant.client, queue["id"], "a", concurrency_key="spent/1")
    ConcurrencyKey.objects.update_or_create(
        namespace_id=tenant.namespace_id, key="spent/1", defaults={"version": 2**64 - 2, "updated_at": timezone.now()}
    )
    (item,) = blockers(tenant, task["id"])["items"]
    assert item["code"] == "KEY_TOKENS_EXHAUSTED" and item["highest_token"] == str(2**64 - 2)
    assert leased_ids(tenant, queue["id"]) == []


def test_no_worker_for_the_queue_the_handler_or_keyed_work(tenant):
    queue = make_queue(tenant.client, "unserved")
    task = submit_ok(tenant.client, queue["id"], "t", concurrency_key="doc/1")
    (item,) = blockers(tenant, task["id"])["items"]
    assert item["code"] == "NO_WORKER" and item["reason"] == "no connected worker consumes this queue"
    # a worker of the queue that serves another handler: its lease does not take the task
    connected(tenant, queue["id"], handlers=[["other", "v1"]])
    (item,) = blockers(tenant, task["id"])["items"]
    assert item["reason"] == "no connected worker of this queue serves this handler and version"
    assert leased_ids(tenant, queue["id"], handlers=(("other", "v1"),)) == []
    # a worker of the handler that did not opt in to keyed work: neither
    connected(tenant, queue["id"], handlers=[["echo", "v1"]], keys=False)
    (item,) = blockers(tenant, task["id"])["items"]
    assert item["reason"] == "no connected worker of this queue accepts keyed tasks"
    assert leased_ids(tenant, queue["id"], handlers=(("echo", "v1"),), keys=False) == []
    # a worker that would take it: no blocker, and its lease takes it
    connected(tenant, queue["id"], handlers=[["echo", "v1"]])
    assert codes(tenant, task["id"]) == []
    assert leased_ids(tenant, queue["id"], handlers=(("echo", "v1"),)) == [task["id"]]


def test_a_stale_session_is_not_a_connected_worker(tenant):
    queue = make_queue(tenant.client, "stale")
    connected(tenant, queue["id"])
    WorkerIdentity.objects.update(seen_at=timezone.now() - timedelta(minutes=5))
    task = submit_ok(tenant.client, queue["id"], "t")
    assert codes(tenant, task["id"]) == ["NO_WORKER"]


def test_every_reason_at_once_and_the_scope_rules(tenant):
    queue = make_queue(tenant.client, "all", max_concurrency=1)
    task = submit_ok(tenant.client, queue["id"], "t", available_at=in_seconds(600))
    configure_queue(tenant.client, queue["id"], paused=True)
    assert codes(tenant, task["id"]) == ["NOT_YET_AVAILABLE", "QUEUE_PAUSED", "NO_WORKER"]
    assert_error(tenant.client.get(f"/v1/tasks/{'0' * 32}/blockers"), 404, "NOT_FOUND")


# Issue 35 (6): the blockers named a key's holder outside the credential's queue
# range (its task, attempt and worker ids, while GET of that task answered 404)
# and the application's counters to a credential without applications:manage.
# Each such reason is reduced to its code and message.


def test_a_holder_outside_the_queue_range_is_only_named_as_held(tenant):
    # given a key held by a task of queue "there", and a task of the key waiting in "here"
    here, there = make_queue(tenant.client, "here"), make_queue(tenant.client, "there")
    connected(tenant, here["id"])
    holder = submit_ok(tenant.client, there["id"], "a", concurrency_key="invoice/7")
    (assign,) = rounds.lease_tasks(worker=worker_for(tenant, there["id"], worker_id="w-there"), limit=16)
    waiting = submit_ok(tenant.client, here["id"], "b", concurrency_key="invoice/7")
    # when a credential scoped to "here" asks why its task waits
    narrow = api_client(make_credential(tenant.namespace, scopes=["tasks:read"], queue_ids=[here["id"]]).token)
    answer = assert_ok(narrow.get(f"/v1/tasks/{waiting['id']}/blockers"))
    # then it learns the key is held, and nothing of the holder it may not read
    assert answer == {"state": "WAITING", "items": [{"code": "KEY_HELD", "message": MESSAGES["KEY_HELD"]}]}
    for foreign in (holder["id"], assign["attempt_id"], "w-there", there["id"]):
        assert foreign not in json.dumps(answer)
    assert_error(narrow.get(f"/v1/tasks/{holder['id']}"), 404, "NOT_FOUND")
    # a credential whose range covers the holder's queue reads every fact
    both = api_client(
        make_credential(tenant.namespace, scopes=["tasks:read"], queue_ids=[here["id"], there["id"]]).token
    )
    (item,) = assert_ok(both.get(f"/v1/tasks/{waiting['id']}/blockers"))["items"]
    assert (item["attempt_id"], item["task_id"], item["worker_id"]) == (assign["attempt_id"], holder["id"], "w-there")


def test_the_application_counters_need_applications_manage(tenant):
    queue = make_queue(tenant.client, "quota")
    connected(tenant, queue["id"])
    Application.objects.filter(id=tenant.namespace.application_id).update(max_active_attempts=1)
    submit_ok(tenant.client, queue["id"], "a")
    second = submit_ok(tenant.client, queue["id"], "b")
    rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=1)
    # the tenant's credential has every scope but applications:manage
    assert "applications:manage" not in ALL_SCOPES
    (item,) = assert_ok(tenant.client.get(f"/v1/tasks/{second['id']}/blockers"))["items"]
    assert item == {"code": "APPLICATION_QUOTA_FULL", "message": MESSAGES["APPLICATION_QUOTA_FULL"]}
    manager = api_client(make_credential(tenant.namespace, scopes=[*ALL_SCOPES, "applications:manage"]).token)
    (item,) = assert_ok(manager.get(f"/v1/tasks/{second['id']}/blockers"))["items"]
    assert (item["active_attempts"], item["max_active_attempts"]) == (1, 1)

"""Issue 35 (6): GET /v1/tasks/{id}/blockers named a key's holder outside the
credential's queue range (its task, attempt and worker ids, while GET of that
task answered 404) and the application's counters to a credential without
`applications:manage`. Each such reason is reduced to its code and message."""

from __future__ import annotations

import json

import pytest

from orbit.models import Application
from tasks.actions import rounds
from tasks.actions.blockers import MESSAGES
from tests.conftest import api_client
from tests.support.factories import ALL_SCOPES, make_credential
from tests.support.tasks import assert_error, assert_ok, make_queue, submit_ok, worker_for
from tests.tasks.test_blockers import connected

pytestmark = pytest.mark.django_db


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

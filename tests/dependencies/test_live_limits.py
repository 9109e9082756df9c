"""Dependencies (SPEC §3, §13) against a live server (daphne, its own process, the
serving timeouts): POST /v1/tasks's fast route refuses bad dependency fields
as a 400 naming them, and a batch within every documented limit is served."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from tasks.models import Task
from tests.conftest import post_json
from tests.support.api import make_queue
from tests.support.tasks import assert_invariants, submit_ok, task_body

pytestmark = pytest.mark.django_db(transaction=True)


def http_post(url: str, token: str, raw: bytes, key: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    request = urllib.request.Request(url, data=raw, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ('"depends_on": null', "depends_on"),
        ('"depends_on": ["\\ud800"]', "depends_on[0]"),
        ('"depends_on": [%s]', "depends_on[0]"),  # the parent's id as a number-less object
        ('"depends_on": ["ref:x"]', "depends_on[0]"),
        ('"depends_on": ["%s", "%s"]', "depends_on[1]"),
        ('"depends_on": ["%s"], "on_dependency_failure": null', "on_dependency_failure"),
        ('"depends_on": ["%s"], "on_dependency_failure": "\\ud800"', "on_dependency_failure"),
    ],
)
def test_the_fast_route_refuses_bad_dependency_fields_naming_them(orbit_server, tenant, fields, named):
    queue = make_queue(tenant.client, "live", max_concurrency=10, rate_per_second=1000)
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    if fields == '"depends_on": [%s]':
        fields = '"depends_on": [{"id": "%s"}]'
    fields = fields.replace("%s", parent)
    raw = (
        f'{{"queue_id": "{queue["id"]}", "handler": "echo", "handler_version": "v1", "payload_version": "v1", '
        f'"payload": {{}}, {fields}}}'
    ).encode()
    status, body = http_post(orbit_server.url + "/v1/tasks", tenant.token, raw, key="bad")
    assert status == 400, body
    assert body["error"]["code"] == "INVALID_ARGUMENT"
    assert body["error"]["message"].startswith(named), body
    assert Task.objects.filter(queue_id=queue["id"]).count() == 1


def test_a_batch_names_at_most_ten_thousand_dependencies_and_ten_wide_joins_are_served(orbit_server, tenant):
    """110 joins of 1,000 dependencies each fit the 4 MiB body, 500 items and 1,000 ids a
    task, but their 110,000 edges outlived the request's deadline under the application's
    lock (a 503 however often retried): refused whole, naming the item past 10,000 ids.
    Ten such joins, the most a batch may name, are served by the live server."""
    queue = make_queue(tenant.client, "wide", max_concurrency=10, rate_per_second=1000)
    parents: list[str] = []
    for first in range(0, 1000, 500):
        items = [{"idempotency_key": f"p-{n}", "task": task_body(queue["id"])} for n in range(first, first + 500)]
        results = post_json(tenant.client, "/v1/tasks:batch", {"tasks": items}).json()["data"]["results"]
        parents += [result["task"]["id"] for result in results]

    def joins(count: int) -> bytes:
        items = [
            {"idempotency_key": f"join-{n}", "task": task_body(queue["id"], payload={}, depends_on=parents)}
            for n in range(count)
        ]
        return json.dumps({"tasks": items}).encode()

    raw = joins(110)
    assert len(raw) < 4 * 1024 * 1024
    status, body = http_post(orbit_server.url + "/v1/tasks:batch", tenant.token, raw)
    assert status == 400, body
    assert body["error"] == {
        "code": "INVALID_ARGUMENT",
        "message": "tasks[10].task.depends_on: a batch names at most 10000 dependencies in all; "
        "send the rest in another batch",
    }
    assert not Task.objects.filter(state="BLOCKED").exists()
    status, body = http_post(orbit_server.url + "/v1/tasks:batch", tenant.token, joins(10))
    assert status == 200, body
    assert [result["status"] for result in body["data"]["results"]] == [201] * 10
    assert Task.objects.filter(state="BLOCKED").count() == 10
    assert_invariants()

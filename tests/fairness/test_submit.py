"""fairness_key on POST /v1/tasks and its batch (SPEC §12): the rules of
concurrency_key, in the body digest, shown where the task is, and the queue's
fair_shares switch set by the first keyed task it accepts."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from orbit.models import IdempotencyRecord
from queues.models import QueueState
from tasks.models import Task
from tests.conftest import post_json
from tests.support.api import assert_error, assert_invalid, assert_ok, make_queue
from tests.support.tasks import get_task, numbered_task, submit, submit_ok, task_body

pytestmark = pytest.mark.django_db

EMOJI = "\U0001f600"


@pytest.fixture
def queue(tenant):
    return make_queue(tenant.client, "fair", rate_per_second=1000)


def fair_shares(queue_id: str) -> bool:
    return QueueState.objects.get(queue_id=queue_id).fair_shares


def post_batch(client, items):
    return post_json(client, "/v1/tasks:batch", {"tasks": items})


def assert_rejected(tenant, response):
    """400 naming fairness_key; nothing accepted, no record kept but the queue's."""
    message = assert_invalid(response, "fairness_key")
    assert Task.objects.count() == 0
    assert IdempotencyRecord.objects.filter(namespace_id=tenant.namespace_id).count() == 1
    return message


@pytest.mark.parametrize("body", [{}, {"fairness_key": ""}], ids=["omitted", "empty"])
def test_no_key_is_no_group_and_is_not_shown(tenant, queue, body):
    task = submit_ok(tenant.client, queue["id"], "t-1", **body)
    assert "fairness_key" not in task
    assert "fairness_key" not in get_task(tenant.client, task["id"])
    (summary,) = assert_ok(tenant.client.get("/v1/tasks", {"queue_id": queue["id"]}))["items"]
    assert "fairness_key" not in summary
    assert Task.objects.get(id=task["id"]).fairness_key == ""
    assert fair_shares(queue["id"]) is False


@pytest.mark.parametrize(
    "key", ["A", "键", EMOJI, "a" * 191, "键" * 191, EMOJI * 191, "tenant 42", "e\u0301", "a\u00a0b"], ids=repr
)
def test_a_key_is_kept_exactly_and_shown(tenant, queue, key):
    task = submit_ok(tenant.client, queue["id"], "t-1", fairness_key=key)
    assert task["fairness_key"] == key
    assert get_task(tenant.client, task["id"])["fairness_key"] == key
    (summary,) = assert_ok(tenant.client.get("/v1/tasks", {"queue_id": queue["id"]}))["items"]
    assert summary["fairness_key"] == key and "payload" not in summary
    assert Task.objects.get(id=task["id"]).fairness_key == key


@pytest.mark.parametrize("key", ["a" * 192, "键" * 192, EMOJI * 192], ids=["ascii", "cjk", "emoji"])
def test_192_characters_are_rejected(tenant, queue, key):
    assert_rejected(tenant, submit(tenant.client, queue["id"], "t-1", fairness_key=key))


@pytest.mark.parametrize("value", [None, 0, 1.5, ["A"], {"k": "v"}, True], ids=repr)
def test_a_non_string_is_rejected(tenant, queue, value):
    assert_rejected(tenant, submit(tenant.client, queue["id"], "t-1", fairness_key=value))


@pytest.mark.parametrize("key", ["\u0000", "a\nb", "key\u007f", "\u0085x"], ids=repr)
def test_control_characters_are_rejected(tenant, queue, key):
    message = assert_rejected(tenant, submit(tenant.client, queue["id"], "t-1", fairness_key=key))
    assert message == "fairness_key: must not contain control characters"


@pytest.mark.parametrize("key", [" A", "A ", "\u3000", "A\u2003"], ids=repr)
def test_whitespace_at_either_end_is_rejected(tenant, queue, key):
    message = assert_rejected(tenant, submit(tenant.client, queue["id"], "t-1", fairness_key=key))
    assert message == "fairness_key: must not start or end with whitespace"


def test_the_messages_are_concurrency_keys(tenant, queue):
    for value in ("a" * 192, 7, "\t", " x"):
        fair = assert_invalid(submit(tenant.client, queue["id"], "t-f", fairness_key=value), "fairness_key")
        keyed = assert_invalid(submit(tenant.client, queue["id"], "t-c", concurrency_key=value), "concurrency_key")
        assert fair.removeprefix("fairness_key") == keyed.removeprefix("concurrency_key")


def test_the_key_is_in_the_digest(tenant, queue):
    first = submit_ok(tenant.client, queue["id"], "t-1", fairness_key="A")
    # the same body replays
    again = assert_ok(submit(tenant.client, queue["id"], "t-1", fairness_key="A"))
    assert again["deduplicated"] is True and again["task"] == first
    # another key, no key, or an empty one under the same Idempotency-Key is another request
    for body in ({"fairness_key": "B"}, {}, {"fairness_key": ""}):
        assert_error(submit(tenant.client, queue["id"], "t-1", **body), 409, "IDEMPOTENCY_CONFLICT")
    assert Task.objects.count() == 1


def test_a_batch_item_takes_the_key_with_the_same_rules(tenant, queue):
    items = [
        {"idempotency_key": "b-1", "task": numbered_task(queue["id"], 1, fairness_key="A")},
        {"idempotency_key": "b-2", "task": numbered_task(queue["id"], 2, fairness_key="A ")},
        {"idempotency_key": "b-3", "task": numbered_task(queue["id"], 3)},
    ]
    results = assert_ok(post_batch(tenant.client, items))["results"]
    assert results[0]["status"] == 201 and results[0]["task"]["fairness_key"] == "A"
    assert results[1]["status"] == 400 and results[1]["error"]["code"] == "INVALID_ARGUMENT"
    assert results[1]["error"]["message"] == "fairness_key: must not start or end with whitespace"
    assert results[2]["status"] == 201 and "fairness_key" not in results[2]["task"]
    # a batch item replays from the single endpoint only with the same key
    single = submit(tenant.client, queue["id"], "b-1", payload={"n": 1}, fairness_key="A")
    assert assert_ok(single)["task"] == results[0]["task"]
    other = post_json(tenant.client, "/v1/tasks", task_body(queue["id"], payload={"n": 1}, fairness_key="B"), key="b-1")
    assert_error(other, 409, "IDEMPOTENCY_CONFLICT")
    assert fair_shares(queue["id"]) is True


def test_the_first_keyed_task_turns_fair_shares_on_for_good(tenant, queue):
    other = make_queue(tenant.client, "other")
    submit_ok(tenant.client, queue["id"], "t-1")
    assert fair_shares(queue["id"]) is False
    submit_ok(tenant.client, queue["id"], "t-2", fairness_key="A")
    assert fair_shares(queue["id"]) is True and fair_shares(other["id"]) is False
    submit_ok(tenant.client, queue["id"], "t-3")
    assert fair_shares(queue["id"]) is True


def test_the_switch_rides_the_counters_update(tenant, queue):
    # one UPDATE of the queue's state row per submit, keyed or not, first keyed or later
    for n, key in enumerate(("", "A", "B", "")):
        with CaptureQueriesContext(connection) as queries:
            submit_ok(tenant.client, queue["id"], f"t-{n}", fairness_key=key)
        sent = " ; ".join(query["sql"] for query in queries)
        updates = re.findall(r"UPDATE [`\"]?orbit_queue_state[`\"]? SET ([^;]*?) WHERE", sent)
        assert len(updates) == 1, sent
        assert ("fair_shares" in updates[0]) == (n == 1), updates
    assert QueueState.objects.get(queue_id=queue["id"]).unfinished_tasks == 4


def test_a_refused_keyed_task_leaves_the_switch_off(tenant):
    full = make_queue(tenant.client, "full", max_unfinished_tasks=1)
    submit_ok(tenant.client, full["id"], "t-1")
    assert_error(submit(tenant.client, full["id"], "t-2", fairness_key="A"), 429, "QUEUE_FULL")
    assert fair_shares(full["id"]) is False

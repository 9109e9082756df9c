"""concurrency_key on POST /v1/tasks: the seed's field rules, idempotency and where the key shows."""

from __future__ import annotations

import json

import pytest

from orbit.models import IdempotencyRecord
from tasks.models import Task
from tests.conftest import post_json
from tests.support.api import assert_invalid, assert_ok, make_queue
from tests.support.keys import TOKEN, get_task, raw_task_json, submit, task_body
from tests.support.tasks import assert_invariants

EMOJI = "\U0001f600"


@pytest.fixture
def queue(tenant):
    return make_queue(tenant.client, "keyed", rate_per_second=1000)


def send(tenant, queue_id, key_value, idem="k-1"):
    return post_json(tenant.client, "/v1/tasks", task_body(queue_id, concurrency_key=key_value), key=idem)


def assert_rejected(tenant, response):
    """400 INVALID_ARGUMENT naming concurrency_key; nothing accepted, no idempotency record kept."""
    message = assert_invalid(response, "concurrency_key")
    assert Task.objects.count() == 0
    assert IdempotencyRecord.objects.filter(namespace_id=tenant.namespace_id).count() == 1  # the queue's only
    return message


def test_omitted_key_means_unkeyed(tenant, queue):
    task = submit(tenant, queue["id"], "t-omitted")
    assert "concurrency_key" not in task
    assert "concurrency_key" not in get_task(tenant, task["id"])
    assert Task.objects.get(id=task["id"]).concurrency_key == ""


def test_empty_key_means_unkeyed(tenant, queue):
    task = submit(tenant, queue["id"], "t-empty", concurrency_key="")
    assert "concurrency_key" not in task
    assert "concurrency_key" not in get_task(tenant, task["id"])
    summaries = assert_ok(tenant.client.get("/v1/tasks", {"queue_id": queue["id"]}))["items"]
    assert [s["id"] for s in summaries] == [task["id"]] and "concurrency_key" not in summaries[0]


@pytest.mark.parametrize(
    "key",
    [
        "k",
        "键",
        EMOJI,
        "a" * 191,
        "键" * 191,
        EMOJI * 191,
        "a b",
        "object/42",
        "a\u00a0b\u3000c",
        "k\u200b",  # ZERO WIDTH SPACE is format (Cf), not Unicode whitespace
        "e\u0301",
    ],
    ids=[
        "1-ascii",
        "1-cjk",
        "1-emoji",
        "191-ascii",
        "191-cjk",
        "191-emoji",
        "inner-space",
        "slash",
        "inner-nbsp",
        "zwsp",
        "decomposed",
    ],
)
def test_valid_keys_are_kept_exactly(tenant, queue, key):
    # given a key of 1–191 characters (counted as Unicode characters, not bytes)
    response = send(tenant, queue["id"], key)
    # then it is accepted and returned exactly as sent, in the receipt and the detail
    task = assert_ok(response, 201)["task"]
    assert task["concurrency_key"] == key
    assert get_task(tenant, task["id"])["concurrency_key"] == key
    assert Task.objects.get(id=task["id"]).concurrency_key == key


def test_key_sent_as_raw_utf8_is_accepted(tenant, queue):
    body = json.dumps(task_body(queue["id"], concurrency_key="键" * 190 + EMOJI), ensure_ascii=False)
    response = post_json(tenant.client, "/v1/tasks", body.encode("utf-8"), key="raw-utf8")
    assert assert_ok(response, 201)["task"]["concurrency_key"] == "键" * 190 + EMOJI


@pytest.mark.parametrize(
    "key", ["a" * 192, "键" * 192, EMOJI * 192, "键" * 191 + "a"], ids=["ascii", "cjk", "emoji", "mixed"]
)
def test_192_characters_are_rejected(tenant, queue, key):
    assert_rejected(tenant, send(tenant, queue["id"], key))


def test_null_key_is_rejected(tenant, queue):
    assert_rejected(tenant, send(tenant, queue["id"], None))


@pytest.mark.parametrize("value", [0, 42, 1.5, ["object/42"], [], {"k": "v"}, True, False], ids=repr)
def test_non_string_key_is_rejected(tenant, queue, value):
    assert_rejected(tenant, send(tenant, queue["id"], value))


CONTROLS = ["\u0000", "\n", "\t", "\r", "\u001f", "\u007f", "\u0080", "\u0085", "\u009f"]


@pytest.mark.parametrize("control", CONTROLS, ids=lambda c: f"U+{ord(c):04X}")
@pytest.mark.parametrize("where", ["start", "middle", "end", "alone"])
def test_control_characters_anywhere_are_rejected(tenant, queue, control, where):
    key = {"start": control + "key", "middle": "k" + control + "ey", "end": "key" + control, "alone": control}[where]
    assert_rejected(tenant, send(tenant, queue["id"], key))


SPACES = [" ", "\u00a0", "\u3000", "\u2003", "\u2028", "\u2029", "\u1680", "\u202f", "\u205f"]


@pytest.mark.parametrize("space", SPACES, ids=lambda c: f"U+{ord(c):04X}")
@pytest.mark.parametrize("where", ["start", "end", "alone"])
def test_unicode_whitespace_at_either_end_is_rejected(tenant, queue, space, where):
    key = {"start": space + "key", "end": "key" + space, "alone": space}[where]
    assert_rejected(tenant, send(tenant, queue["id"], key))


@pytest.mark.parametrize("space", [" ", "\u00a0", "\u3000", "\u2003"], ids=lambda c: f"U+{ord(c):04X}")
def test_unicode_whitespace_inside_is_allowed(tenant, queue, space):
    task = assert_ok(send(tenant, queue["id"], f"a{space}b"), 201)["task"]
    assert task["concurrency_key"] == f"a{space}b"


@pytest.mark.parametrize(
    "escaped", [r'"\ud800"', r'"a\ud800b"', r'"\udfff"', r'"key\udc00"', r'"\udc00\ud800"'], ids=str
)
def test_lone_surrogate_escape_is_rejected_not_500(tenant, queue, escaped):
    response = post_json(tenant.client, "/v1/tasks", raw_task_json(queue["id"], escaped), key="surrogate")
    assert_rejected(tenant, response)


def test_valid_surrogate_pair_escape_is_one_character(tenant, queue):
    response = post_json(tenant.client, "/v1/tasks", raw_task_json(queue["id"], r'"\ud83d\ude00"'), key="pair")
    assert assert_ok(response, 201)["task"]["concurrency_key"] == EMOJI


def test_rejected_key_keeps_the_idempotency_key_free(tenant, queue):
    # given a request refused for its key
    assert_rejected(tenant, send(tenant, queue["id"], " padded", idem="retry-me"))
    # when the caller fixes the key and sends under the same Idempotency-Key
    task = assert_ok(send(tenant, queue["id"], "padded", idem="retry-me"), 201)["task"]
    # then it is accepted: the refusal stored nothing
    assert task["concurrency_key"] == "padded"


def test_replay_with_same_key_returns_original_receipt(tenant, queue):
    first = assert_ok(send(tenant, queue["id"], "object/42", idem="update-object-42-operation-001"), 201)
    again = assert_ok(send(tenant, queue["id"], "object/42", idem="update-object-42-operation-001"), 200)
    assert first["deduplicated"] is False and again["deduplicated"] is True
    assert again["task"] == first["task"]
    assert again["task"]["concurrency_key"] == "object/42"
    assert Task.objects.count() == 1


@pytest.mark.parametrize("other", ["object/43", "object/4", "Object/42", "object/42\u200b", None, "", "omit"])
def test_replay_with_another_key_conflicts(tenant, queue, other):
    assert_ok(send(tenant, queue["id"], "object/42", idem="update-object-42-operation-001"), 201)
    body = task_body(queue["id"])
    if other != "omit":
        body["concurrency_key"] = other
    response = post_json(tenant.client, "/v1/tasks", body, key="update-object-42-operation-001")
    assert response.status_code == 409, response.content
    assert response.json()["error"]["code"] == "IDEMPOTENCY_CONFLICT"
    assert Task.objects.count() == 1
    assert Task.objects.get().concurrency_key == "object/42"


def test_replay_of_unkeyed_with_a_key_conflicts(tenant, queue):
    assert_ok(post_json(tenant.client, "/v1/tasks", task_body(queue["id"]), key="plain"), 201)
    response = send(tenant, queue["id"], "object/42", idem="plain")
    assert response.status_code == 409 and response.json()["error"]["code"] == "IDEMPOTENCY_CONFLICT"


def test_key_shows_in_detail_and_summaries_and_filters_exactly(tenant, queue):
    keys = ["object/A", "object/a", "\u00e9", "e\u0301", "对象/42", "object/A/1"]
    ids = {key: submit(tenant, queue["id"], f"t-{i}", concurrency_key=key)["id"] for i, key in enumerate(keys)}
    unkeyed = submit(tenant, queue["id"], "t-plain")["id"]
    for key, task_id in ids.items():
        assert get_task(tenant, task_id)["concurrency_key"] == key
    summaries = assert_ok(tenant.client.get("/v1/tasks", {"queue_id": queue["id"]}))["items"]
    by_id = {s["id"]: s for s in summaries}
    assert {task_id: by_id[task_id]["concurrency_key"] for task_id in ids.values()} == {v: k for k, v in ids.items()}
    assert "concurrency_key" not in by_id[unkeyed] and "payload" not in by_id[unkeyed]
    for key, task_id in ids.items():
        # the filter is exact: no case folding, no normalization, no prefix match
        found = assert_ok(tenant.client.get("/v1/tasks", {"concurrency_key": key}))["items"]
        assert [s["id"] for s in found] == [task_id], key
        assert found[0]["concurrency_key"] == key
    assert assert_ok(tenant.client.get("/v1/tasks", {"concurrency_key": "object/"}))["items"] == []
    assert assert_ok(tenant.client.get("/v1/tasks", {"concurrency_key": "OBJECT/A"}))["items"] == []


@pytest.mark.django_db(transaction=True)
def test_key_and_token_in_task_assign(tenant, connect):
    # given a keyed task (with characters outside ASCII) and an unkeyed one
    queue = make_queue(tenant.client, "assign", rate_per_second=1000)
    keyed = submit(tenant, queue["id"], "t-keyed", concurrency_key="对象/42 ✓", business_key="biz-1")
    plain = submit(tenant, queue["id"], "t-plain")
    # when an opted-in worker leases both
    worker = connect(tenant, [queue["id"]], "w-assign", capacity=2)
    frames = {f["task"]["id"]: f for f in (worker.expect_assignment(), worker.expect_assignment())}
    # then the keyed assignment names the key and carries a token; the other has neither
    assert frames[keyed["id"]]["task"]["concurrency_key"] == "对象/42 ✓"
    assert frames[keyed["id"]]["task"]["business_key"] == "biz-1"
    assert TOKEN.fullmatch(frames[keyed["id"]]["concurrency_token"])
    assert "concurrency_key" not in frames[plain["id"]]["task"]
    assert "concurrency_token" not in frames[plain["id"]]
    for frame in frames.values():
        worker.finish(frame)
    assert_invariants()

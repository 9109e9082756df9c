"""GET /v1/tasks, /v1/tasks/{id}, /v1/tasks/{id}/attempts, /v1/attempts/{id} (SPEC §5)."""

from __future__ import annotations

import pytest

from tasks.actions import endings, rounds
from tests.conftest import api_client
from tests.support.api import HEX32, assert_error, assert_invalid, assert_ok, make_queue, parse_time
from tests.support.factories import NamespaceFactory, make_credential
from tests.support.tasks import TASK_REQUIRED_KEYS, assert_no_nulls, get_task, in_seconds, lease_one, submit_ok

pytestmark = pytest.mark.django_db


def test_detail_has_the_payload_and_omits_empty_optionals(tenant):
    queue = make_queue(tenant.client)
    task = submit_ok(tenant.client, queue["id"], "t-1", payload={"big": [1, 2, 3]})
    detail = get_task(tenant.client, task["id"])
    assert detail == task
    assert detail["payload"] == {"big": [1, 2, 3]}
    assert set(detail) == TASK_REQUIRED_KEYS | {"payload"}
    assert_no_nulls(detail)


def test_detail_shows_optionals_once_set(tenant):
    queue = make_queue(tenant.client)
    task = submit_ok(
        tenant.client,
        queue["id"],
        "t-1",
        business_key="b-1",
        concurrency_key="k-1",
        start_deadline_at=in_seconds(600),
        deadline_at=in_seconds(900),
    )
    detail = get_task(tenant.client, task["id"])
    assert {"business_key", "concurrency_key", "start_deadline_at", "deadline_at"} <= set(detail)
    assert "finished_at" not in detail and "output" not in detail and "last_error" not in detail
    assert_no_nulls(detail)


def test_list_items_are_summaries_without_payload(tenant):
    queue = make_queue(tenant.client)
    tasks = [submit_ok(tenant.client, queue["id"], f"t-{i}", payload={"i": i}) for i in range(3)]
    data = assert_ok(tenant.client.get("/v1/tasks"))
    assert set(data) == {"items", "next_page_token"}
    assert data["next_page_token"] == ""
    assert sorted(item["id"] for item in data["items"]) == sorted(t["id"] for t in tasks)
    for item in data["items"]:
        assert "payload" not in item
        assert set(item) == TASK_REQUIRED_KEYS
        assert_no_nulls(item)
        full = next(t for t in tasks if t["id"] == item["id"])
        assert item == {k: v for k, v in full.items() if k != "payload"}


def test_list_filters(tenant):
    # given tasks spread over two queues, keys and states
    q1, q2 = make_queue(tenant.client, "one"), make_queue(tenant.client, "two")
    a = submit_ok(tenant.client, q1["id"], "a", business_key="order-1", concurrency_key="printer")
    b = submit_ok(tenant.client, q1["id"], "b", business_key="order-2")
    c = submit_ok(tenant.client, q2["id"], "c", business_key="order-1", concurrency_key="Printer")
    d = submit_ok(tenant.client, q2["id"], "d")
    lease_one(tenant, q2["id"])  # c or d becomes LEASED (same priority: oldest first → c)

    def ids(query: str) -> set[str]:
        return {item["id"] for item in assert_ok(tenant.client.get(f"/v1/tasks?{query}"))["items"]}

    assert ids(f"queue_id={q1['id']}") == {a["id"], b["id"]}
    assert ids(f"queue_id={q2['id']}") == {c["id"], d["id"]}
    assert ids("business_key=order-1") == {a["id"], c["id"]}
    # keys match byte for byte: case is not folded
    assert ids("concurrency_key=printer") == {a["id"]}
    assert ids("concurrency_key=Printer") == {c["id"]}
    assert ids("state=LEASED") == {c["id"]}
    assert ids("state=WAITING") == {a["id"], b["id"], d["id"]}
    assert ids(f"state=WAITING&queue_id={q2['id']}") == {d["id"]}
    assert ids("state=SUCCEEDED") == set()
    assert ids("queue_id=" + "0" * 32) == set()


def test_list_rejects_an_unknown_state(tenant):
    assert_invalid(tenant.client.get("/v1/tasks?state=DONE"), "state")


def test_list_pages_through_every_task_once(tenant):
    queue = make_queue(tenant.client)
    created = {submit_ok(tenant.client, queue["id"], f"t-{i}")["id"] for i in range(7)}
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        query = "page_size=3" + (f"&page_token={token}" if token else "")
        data = assert_ok(tenant.client.get(f"/v1/tasks?{query}"))
        assert len(data["items"]) <= 3
        seen.extend(item["id"] for item in data["items"])
        pages += 1
        token = data["next_page_token"]
        if not token:
            break
        assert pages < 10
    assert pages == 3
    assert len(seen) == len(set(seen)) and set(seen) == created


@pytest.mark.parametrize("query", ["page_size=0", "page_size=501", "page_size=x", "page_token=a", "page_token=%%%"])
def test_list_rejects_bad_paging(tenant, query):
    assert_error(tenant.client.get(f"/v1/tasks?{query}"), 400, "INVALID_ARGUMENT")


def test_queue_range_hides_tasks_outside_it(tenant):
    # given a credential limited to queue one
    one, two = make_queue(tenant.client, "one"), make_queue(tenant.client, "two")
    inside = submit_ok(tenant.client, one["id"], "in")
    outside = submit_ok(tenant.client, two["id"], "out")
    narrow = api_client(make_credential(tenant.namespace, queue_ids=[one["id"]]).token)
    # then a single task outside the range is 404, never 403
    assert_error(narrow.get(f"/v1/tasks/{outside['id']}"), 404, "NOT_FOUND")
    assert_error(narrow.get(f"/v1/tasks/{outside['id']}/attempts"), 404, "NOT_FOUND")
    assert_ok(narrow.get(f"/v1/tasks/{inside['id']}"))
    # and lists show only the range, even when asked for the other queue
    assert [t["id"] for t in assert_ok(narrow.get("/v1/tasks"))["items"]] == [inside["id"]]
    assert assert_ok(narrow.get(f"/v1/tasks?queue_id={two['id']}"))["items"] == []


def test_attempt_outside_the_range_is_404(tenant):
    one, two = make_queue(tenant.client, "one"), make_queue(tenant.client, "two")
    submit_ok(tenant.client, two["id"], "out")
    leased = lease_one(tenant, two["id"])
    narrow = api_client(make_credential(tenant.namespace, queue_ids=[one["id"]]).token)
    assert_error(narrow.get(f"/v1/attempts/{leased['attempt_id']}"), 404, "NOT_FOUND")
    assert_ok(tenant.client.get(f"/v1/attempts/{leased['attempt_id']}"))


def test_task_of_another_namespace_is_404(tenant):
    queue = make_queue(tenant.client)
    task = submit_ok(tenant.client, queue["id"], "t-1")
    stranger = api_client(make_credential(NamespaceFactory()).token)
    assert_error(stranger.get(f"/v1/tasks/{task['id']}"), 404, "NOT_FOUND")
    assert assert_ok(stranger.get("/v1/tasks"))["items"] == []
    assert_error(tenant.client.get("/v1/tasks/" + "f" * 32), 404, "NOT_FOUND")


def test_reads_need_tasks_read(tenant):
    queue = make_queue(tenant.client)
    task = submit_ok(tenant.client, queue["id"], "t-1")
    submitter = api_client(make_credential(tenant.namespace, scopes=["tasks:submit"]).token)
    assert_error(submitter.get(f"/v1/tasks/{task['id']}"), 403, "PERMISSION_DENIED")
    assert_error(submitter.get("/v1/tasks"), 403, "PERMISSION_DENIED")
    assert_error(api_client(None).get("/v1/tasks"), 401, "UNAUTHENTICATED")


def test_attempts_page_in_lease_order(tenant):
    """Released attempts do not count against max_attempts, so the list pages
    (SPEC §3: page_size 1-500, default 100, an opaque page_token)."""
    queue = make_queue(tenant.client)
    task = submit_ok(tenant.client, queue["id"], "released-often")
    for epoch in range(1, 6):
        leased = lease_one(tenant, queue["id"])
        assert leased["epoch"] == epoch
        endings.release_attempt(worker=leased["worker"], attempt_id=leased["attempt_id"], epoch=epoch, reason="busy")
    lease_one(tenant, queue["id"])
    path = f"/v1/tasks/{task['id']}/attempts"
    everything = assert_ok(tenant.client.get(path))
    assert [a["epoch"] for a in everything["items"]] == [1, 2, 3, 4, 5, 6] and everything["next_page_token"] == ""
    assert [a["state"] for a in everything["items"]] == ["RELEASED"] * 5 + ["LEASED"]
    walked, token, pages = [], None, 0
    while True:
        params = {"page_size": "4", **({"page_token": token} if token else {})}
        data = assert_ok(tenant.client.get(path, params))
        walked += data["items"]
        pages += 1
        token = data["next_page_token"]
        if not token:
            break
    assert pages == 2 and walked == everything["items"]
    exact = assert_ok(tenant.client.get(path, {"page_size": "3"}))
    assert len(exact["items"]) == 3 and exact["next_page_token"]
    last = assert_ok(tenant.client.get(path, {"page_size": "3", "page_token": exact["next_page_token"]}))
    assert [a["epoch"] for a in last["items"]] == [4, 5, 6] and last["next_page_token"] == ""
    for page_size in ("0", "501", "x"):
        assert_invalid(tenant.client.get(path, {"page_size": page_size}), "page_size")
    for page_token in ("zzz", "MA", "YWJj"):  # junk, "0", "abc"
        assert_invalid(tenant.client.get(path, {"page_token": page_token}), "page_token")


def test_attempt_reads(tenant):
    # given a task leased once and started
    queue = make_queue(tenant.client)
    task = submit_ok(tenant.client, queue["id"], "t-1")
    assert assert_ok(tenant.client.get(f"/v1/tasks/{task['id']}/attempts")) == {"items": [], "next_page_token": ""}
    leased = lease_one(tenant, queue["id"])
    # then the leased attempt has no number, start or finish yet
    (attempt,) = assert_ok(tenant.client.get(f"/v1/tasks/{task['id']}/attempts"))["items"]
    assert set(attempt) == {"id", "task_id", "state", "epoch", "worker_id", "leased_at", "lease_expires_at"}
    assert attempt["id"] == leased["attempt_id"] and HEX32.fullmatch(attempt["id"])
    assert attempt["task_id"] == task["id"] and attempt["state"] == "LEASED" and attempt["epoch"] == 1
    assert attempt["worker_id"] == "reader-w"
    assert (parse_time(attempt["lease_expires_at"]) - parse_time(attempt["leased_at"])).total_seconds() == 30
    assert_no_nulls(attempt)
    # when it starts, number and started_at appear
    rounds.approve_start(worker=leased["worker"], attempt_id=leased["attempt_id"], epoch=1)
    one = assert_ok(tenant.client.get(f"/v1/attempts/{leased['attempt_id']}"))
    assert one["state"] == "RUNNING" and one["number"] == 1 and "started_at" in one
    assert "finished_at" not in one and "outcome" not in one and "concurrency_token" not in one
    assert_no_nulls(one)
    assert get_task(tenant.client, task["id"])["state"] == "RUNNING"
    assert_error(tenant.client.get("/v1/attempts/" + "e" * 32), 404, "NOT_FOUND")


def test_keyed_attempt_shows_its_token_as_a_string(tenant):
    queue = make_queue(tenant.client)
    submit_ok(tenant.client, queue["id"], "t-1", concurrency_key="printer")
    leased = lease_one(tenant, queue["id"])
    attempt = assert_ok(tenant.client.get(f"/v1/attempts/{leased['attempt_id']}"))
    assert attempt["concurrency_token"] == "1"

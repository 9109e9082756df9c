"""The read surface of dependencies (SPEC §13): GET /v1/tasks/{id}/dependencies
and /dependents (paginated as every v1 list, tasks:read, 404 as the task GET),
depends_on on the task object, the WAITING_FOR_DEPENDENCIES blocker, and the
events of a blocked task's moves."""

from __future__ import annotations

from typing import Any

import pytest

from orbit.models import SCOPES
from tasks.actions.blockers import MESSAGES
from tasks.models import Task
from tests.conftest import api_client, new_tenant, post_json
from tests.support.api import assert_error, assert_ok, make_queue
from tests.support.dependencies import run_one
from tests.support.factories import make_credential
from tests.support.tasks import cancel, get_task, lease_one, submit_ok, task_body

pytestmark = pytest.mark.django_db

LINK_KEYS = {"id", "queue_id", "handler", "state", "created_at", "updated_at"}


def listing(client: Any, task_id: str, which: str, **params: Any) -> dict[str, Any]:
    return assert_ok(client.get(f"/v1/tasks/{task_id}/{which}", params))


def walk(client: Any, task_id: str, which: str, page_size: int) -> list[list[str]]:
    """Every page's ids, following next_page_token to the end."""
    pages: list[list[str]] = []
    token = ""
    while True:
        params: dict[str, Any] = {"page_size": page_size, **({"page_token": token} if token else {})}
        data = listing(client, task_id, which, **params)
        pages.append([item["id"] for item in data["items"]])
        token = data["next_page_token"]
        if not token:
            return pages
        assert len(pages) < 100, "the walk does not end"


def batch(client: Any, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = assert_ok(post_json(client, "/v1/tasks:batch", {"tasks": items}))["results"]
    assert all(result["status"] == 201 for result in results), results
    return [result["task"] for result in results]


# --- the two lists -------------------------------------------------------


def test_dependencies_are_listed_in_depends_on_order_a_page_at_a_time(tenant, queue):
    parents = [submit_ok(tenant.client, queue["id"], f"p-{n}", business_key=f"bk-{n}") for n in range(5)]
    # an order that is not id order (ids are random: permute them sorted, so it never is by chance)
    by_id = sorted(p["id"] for p in parents)
    order = [by_id[n] for n in (3, 0, 4, 1, 2)]
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=order)
    assert walk(tenant.client, child["id"], "dependencies", page_size=2) == [order[:2], order[2:4], order[4:]]
    assert walk(tenant.client, child["id"], "dependencies", page_size=5) == [order]
    (first, *_) = listing(tenant.client, child["id"], "dependencies")["items"]
    parent = next(p for p in parents if p["id"] == order[0])
    assert first == {
        "id": parent["id"],
        "queue_id": queue["id"],
        "handler": "echo",
        "business_key": parent["business_key"],
        "state": "WAITING",
        "created_at": parent["created_at"],
        "updated_at": parent["updated_at"],
    }
    # a task without dependencies has none, and no dependents either
    assert listing(tenant.client, parent["id"], "dependencies") == {"items": [], "next_page_token": ""}
    assert listing(tenant.client, child["id"], "dependents") == {"items": [], "next_page_token": ""}


def test_a_finished_dependency_shows_its_end(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    run_one(tenant, queue["id"])
    (item,) = listing(tenant.client, child["id"], "dependencies")["items"]
    assert item["state"] == "SUCCEEDED" and item["finished_at"] == get_task(tenant.client, parent["id"])["finished_at"]
    (dependent,) = listing(tenant.client, parent["id"], "dependents")["items"]
    assert (dependent["id"], dependent["state"]) == (child["id"], "WAITING")
    assert set(dependent) == LINK_KEYS


def test_dependents_are_listed_in_edge_order_across_settled_and_open_edges(tenant, queue):
    """Edges to one task, settled and not, interleaved: the list merges the
    two halves of the edge index in edge order, page after page."""
    failed = submit_ok(tenant.client, queue["id"], "failed", max_attempts=1)
    run_one(tenant, queue["id"], "FAILED")
    parent = submit_ok(tenant.client, queue["id"], "parent")
    dependents = []
    for n in range(6):
        # every other one is CANCELLED at admission (its other dependency failed): its edge is settled
        depends_on = [parent["id"], failed["id"]] if n % 2 else [parent["id"]]
        dependents.append(submit_ok(tenant.client, queue["id"], f"d-{n}", depends_on=depends_on))
    assert [d["state"] for d in dependents] == ["BLOCKED", "CANCELLED"] * 3
    ids = [d["id"] for d in dependents]
    for size in (1, 2, 4, 6, 100):
        pages = walk(tenant.client, parent["id"], "dependents", page_size=size)
        assert [i for page in pages for i in page] == ids, size
        assert all(len(page) == size for page in pages[:-1])
    states = [item["state"] for item in listing(tenant.client, parent["id"], "dependents")["items"]]
    assert states == ["BLOCKED", "CANCELLED"] * 3


def test_dependents_in_a_batch_list_in_the_order_they_were_admitted(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    items = [
        {"idempotency_key": f"fan-{n}", "task": task_body(queue["id"], depends_on=[parent["id"]])} for n in range(120)
    ]
    ids = [task["id"] for task in batch(tenant.client, items)]
    first = listing(tenant.client, parent["id"], "dependents")  # the default page size, 100
    assert [item["id"] for item in first["items"]] == ids[:100] and first["next_page_token"]
    rest = listing(tenant.client, parent["id"], "dependents", page_token=first["next_page_token"])
    assert [item["id"] for item in rest["items"]] == ids[100:] and rest["next_page_token"] == ""


@pytest.mark.parametrize("which", ["dependencies", "dependents"])
@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"page_size": "0"}, "page_size: must be an integer between 1 and 500"),
        ({"page_size": "501"}, "page_size: must be an integer between 1 and 500"),
        ({"page_size": "x"}, "page_size: must be an integer between 1 and 500"),
        ({"page_token": "!!"}, "page_token: invalid"),
        ({"page_token": "YWJj"}, "page_token: invalid"),  # "abc": not a cursor these lists issue
        ({"page_token": "MA"}, "page_token: invalid"),  # "0"
    ],
)
def test_bad_paging_is_a_400_as_in_every_list(tenant, queue, which, params, message):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    task_id = child["id"] if which == "dependencies" else parent["id"]
    response = tenant.client.get(f"/v1/tasks/{task_id}/{which}", params)
    assert assert_error(response, 400, "INVALID_ARGUMENT") == message
    # the same message the task list gives
    assert assert_error(tenant.client.get("/v1/tasks", params), 400, "INVALID_ARGUMENT") == message


@pytest.mark.parametrize("which", ["dependencies", "dependents"])
def test_an_unknown_or_foreign_task_is_the_task_gets_404(tenant, queue, which):
    other = new_tenant()
    theirs = submit_ok(other.client, make_queue(other.client)["id"], "theirs")
    for task_id in (theirs["id"], "f" * 32, "not-an-id"):
        expected = tenant.client.get(f"/v1/tasks/{task_id}")
        response = tenant.client.get(f"/v1/tasks/{task_id}/{which}")
        assert assert_error(response, 404, "NOT_FOUND") == assert_error(expected, 404, "NOT_FOUND") == "task not found"


@pytest.mark.parametrize("which", ["dependencies", "dependents"])
def test_the_lists_need_tasks_read(tenant, queue, which):
    task = submit_ok(tenant.client, queue["id"], "task")
    without = [scope for scope in SCOPES if scope != "tasks:read"]
    response = new_tenant(scopes=without).client.get(f"/v1/tasks/{task['id']}/{which}")
    assert assert_error(response, 403, "PERMISSION_DENIED")
    # with tasks:read alone, of the same namespace
    reader = make_credential(tenant.namespace, scopes=["tasks:read"])
    assert api_client(reader.token).get(f"/v1/tasks/{task['id']}/{which}").status_code == 200


def test_a_related_task_outside_the_queue_range_shows_its_id_alone(tenant, queue):
    hidden_queue = make_queue(tenant.client, name="hidden", max_concurrency=100, rate_per_second=1000)
    hidden = submit_ok(tenant.client, hidden_queue["id"], "hidden")
    seen = submit_ok(tenant.client, queue["id"], "seen")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[hidden["id"], seen["id"]])
    hidden_child = submit_ok(tenant.client, hidden_queue["id"], "hidden-child", depends_on=[seen["id"]])
    ranged = api_client(make_credential(tenant.namespace, queue_ids=[queue["id"]]).token)
    items = listing(ranged, child["id"], "dependencies")["items"]
    assert items[0] == {"id": hidden["id"]}
    assert items[1]["id"] == seen["id"] and items[1]["state"] == "WAITING"
    assert listing(ranged, seen["id"], "dependents")["items"][1] == {"id": hidden_child["id"]}
    # a task outside the range itself: 404, as its GET
    for which in ("dependencies", "dependents"):
        assert assert_error(ranged.get(f"/v1/tasks/{hidden['id']}/{which}"), 404, "NOT_FOUND") == "task not found"


def test_a_pruned_task_is_listed_by_its_id_with_no_state(tenant, queue):
    parents = [submit_ok(tenant.client, queue["id"], f"p-{n}") for n in range(2)]
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[p["id"] for p in parents])
    Task.objects.filter(id=parents[0]["id"]).delete()  # as orbit_prune would, once nothing waits for it
    items = listing(tenant.client, child["id"], "dependencies")["items"]
    assert items[0] == {"id": parents[0]["id"], "pruned": True}
    assert items[1]["id"] == parents[1]["id"] and items[1]["state"] == "WAITING"
    Task.objects.filter(id=child["id"]).delete()  # a dependent gone, its edge left
    assert listing(tenant.client, parents[1]["id"], "dependents")["items"] == [{"id": child["id"], "pruned": True}]


# --- the task object ------------------------------------------------------


def test_the_task_object_shows_depends_on_wherever_it_is_answered(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]], on_dependency_failure="RUN")
    expected = {"depends_on": [parent["id"]], "on_dependency_failure": "RUN"}
    listed = {t["id"]: t for t in assert_ok(tenant.client.get("/v1/tasks", {"state": "BLOCKED"}))["items"]}
    (in_batch,) = batch(
        tenant.client, [{"idempotency_key": "b", "task": task_body(queue["id"], depends_on=[parent["id"]])}]
    )
    for answer in (child, get_task(tenant.client, child["id"]), listed[child["id"]]):
        assert {name: answer[name] for name in expected} == expected
    assert (in_batch["depends_on"], in_batch["on_dependency_failure"]) == ([parent["id"]], "CANCEL")
    # omitted when not set, as every optional field
    for answer in (parent, get_task(tenant.client, parent["id"])):
        assert "depends_on" not in answer and "on_dependency_failure" not in answer


# --- blockers -------------------------------------------------------------


def blockers(client: Any, task_id: str) -> dict[str, Any]:
    return assert_ok(client.get(f"/v1/tasks/{task_id}/blockers"))


def test_a_blocked_task_waits_for_its_unfinished_dependencies(tenant, queue):
    parents = [submit_ok(tenant.client, queue["id"], f"p-{n}") for n in range(3)]
    order = [parents[n]["id"] for n in (2, 0, 1)]
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=order)
    assert blockers(tenant.client, child["id"]) == {
        "state": "BLOCKED",
        "items": [
            {"code": "WAITING_FOR_DEPENDENCIES", "message": MESSAGES["WAITING_FOR_DEPENDENCIES"], "task_ids": order}
        ],
    }
    finished = run_one(tenant, queue["id"])["task"]["id"]
    (reason,) = blockers(tenant.client, child["id"])["items"]
    assert reason["task_ids"] == [task_id for task_id in order if task_id != finished]
    run_one(tenant, queue["id"])
    run_one(tenant, queue["id"])
    answer = blockers(tenant.client, child["id"])
    assert answer["state"] == "WAITING"
    assert "WAITING_FOR_DEPENDENCIES" not in [reason["code"] for reason in answer["items"]]


def test_a_needs_review_dependency_still_blocks_and_a_finished_one_at_submit_never_does(tenant, queue):
    done = submit_ok(tenant.client, queue["id"], "done")
    run_one(tenant, queue["id"])
    review = submit_ok(tenant.client, queue["id"], "review")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[done["id"], review["id"]])
    run_one(tenant, queue["id"], "UNKNOWN")
    assert get_task(tenant.client, review["id"])["state"] == "NEEDS_REVIEW"
    (reason,) = blockers(tenant.client, child["id"])["items"]
    assert (reason["code"], reason["task_ids"]) == ("WAITING_FOR_DEPENDENCIES", [review["id"]])


def test_the_blocker_has_the_shape_of_the_other_blocker_codes(tenant, queue):
    """code, message, then the facts; the message is the code's own, as KEY_HELD's."""
    parent = submit_ok(tenant.client, queue["id"], "parent", concurrency_key="k")
    held_by_parent = submit_ok(tenant.client, queue["id"], "second", concurrency_key="k")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    lease_one(tenant, queue["id"])
    (held,) = [r for r in blockers(tenant.client, held_by_parent["id"])["items"] if r["code"] == "KEY_HELD"]
    (waiting,) = blockers(tenant.client, child["id"])["items"]
    for reason in (held, waiting):
        assert list(reason)[:2] == ["code", "message"] and reason["message"] == MESSAGES[reason["code"]]
    assert waiting["task_ids"] == [parent["id"]]


# --- events ---------------------------------------------------------------


def moves(client: Any, task_id: str) -> list[tuple[str, str | None]]:
    """The task's task.state_changed events from GET /v1/events, in cursor order."""
    found: list[tuple[str, str | None]] = []
    params: dict[str, Any] = {"page_size": 500}
    while True:
        data = assert_ok(client.get("/v1/events", params))
        for event in data["items"]:
            if event["subject_id"] == task_id and event["type"] == "task.state_changed":
                found.append((event["data"]["state"], event["data"].get("previous")))
        if not data["items"]:
            return found
        params["after"] = data["items"][-1]["cursor"]


@pytest.mark.parametrize("keyed", [False, True])
def test_blocked_to_waiting_is_evented(tenant, queue, keyed):
    """Unkeyed dependents move in one statement, keyed ones through the
    transition: both leave the same event."""
    parent = submit_ok(tenant.client, queue["id"], "parent")
    child = submit_ok(
        tenant.client, queue["id"], "child", depends_on=[parent["id"]], **({"concurrency_key": "k"} if keyed else {})
    )
    run_one(tenant, queue["id"])
    assert moves(tenant.client, child["id"]) == [("BLOCKED", None), ("WAITING", "BLOCKED")]
    data = assert_ok(tenant.client.get("/v1/events"))["items"]
    (event,) = [e for e in data if e["subject_id"] == child["id"] and e["data"].get("previous") == "BLOCKED"]
    assert event["data"] == {"queue_id": queue["id"], "state": "WAITING", "previous": "BLOCKED"}


def test_blocked_to_cancelled_by_a_failed_dependency_is_evented_after_its_ending(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent", max_attempts=1)
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    grandchild = submit_ok(tenant.client, queue["id"], "grandchild", depends_on=[child["id"]])
    run_one(tenant, queue["id"], "FAILED")
    for task_id in (child["id"], grandchild["id"]):
        assert moves(tenant.client, task_id) == [("BLOCKED", None), ("CANCELLED", "BLOCKED")]
        assert get_task(tenant.client, task_id)["last_error"]["code"] == "DEPENDENCY_FAILED"
    events = assert_ok(tenant.client.get("/v1/events"))["items"]
    endings = [
        (e["subject_id"], e["data"]["state"])
        for e in events
        if e["type"] == "task.state_changed" and e["data"]["state"] in ("FAILED", "CANCELLED")
    ]
    # the parent's ending first, then its dependents', in the cascade's order
    assert endings == [(parent["id"], "FAILED"), (child["id"], "CANCELLED"), (grandchild["id"], "CANCELLED")]


def test_cancelling_a_blocked_task_or_its_dependency_is_evented(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    other = submit_ok(tenant.client, queue["id"], "other", depends_on=[parent["id"]])
    assert cancel(tenant.client, other["id"], "cancel-other").status_code == 200
    assert moves(tenant.client, other["id"]) == [("BLOCKED", None), ("CANCELLED", "BLOCKED")]
    assert cancel(tenant.client, parent["id"], "cancel-parent").status_code == 200
    assert moves(tenant.client, child["id"]) == [("BLOCKED", None), ("CANCELLED", "BLOCKED")]

"""Dependencies in the SDK (SPEC §13): depends_on and on_dependency_failure on submits and batch
items, batch refs, the task's depends_on, the dependencies / dependents reads, and the
assignment's dependencies as execution.dependencies."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

import orbit_sdk
from orbit_sdk import BatchItem, Dependency, ProtocolError, SubmitTaskRequest, Task, TaskLink
from orbit_sdk._attempts import Execution
from orbit_sdk._protocol import parse_assignment
from tests.support.sdk import QUEUE_ID, TASK_ID, TASK_SUMMARY, Recorder, client_for, ok

PARENT_A = "a" * 32
PARENT_B = "b" * 32


def request(**fields: Any) -> SubmitTaskRequest:
    return SubmitTaskRequest(QUEUE_ID, "report.join", "v1", "v1", {"n": 1}, **fields)


def accepted(*keys: str) -> dict[str, Any]:
    return {
        "results": [{"idempotency_key": k, "status": 201, "deduplicated": False, "task": TASK_SUMMARY} for k in keys]
    }


# --------------------------------------------------------------------------- submits


def test_depends_on_and_on_dependency_failure_are_sent_as_given():
    recorder = Recorder(ok({"deduplicated": False, "task": TASK_SUMMARY}))
    client_for(recorder).submit_task("k", request(depends_on=(PARENT_A, PARENT_B), on_dependency_failure="RUN"))
    body = recorder.body()
    assert body["depends_on"] == [PARENT_A, PARENT_B]  # a tuple travels as a JSON list, in order
    assert body["on_dependency_failure"] == "RUN"


def test_a_submit_without_dependencies_sends_neither_field():
    # Both fields are in the body digest: absent must stay absent for an old key to replay.
    body = request().to_json()
    assert "depends_on" not in body and "on_dependency_failure" not in body


@pytest.mark.parametrize("depends_on", [PARENT_A, [PARENT_A, 7], b"ab"])
def test_depends_on_that_is_not_a_list_of_strings_is_refused_before_sending(depends_on: Any):
    recorder = Recorder(ok({}))
    with pytest.raises(TypeError, match="depends_on must be a list"):
        client_for(recorder).submit_task("k", request(depends_on=depends_on))
    assert recorder.requests == []


@pytest.mark.parametrize(
    "given",
    [lambda ids: (i for i in ids), lambda ids: map(str, ids), lambda ids: iter(ids)],
    ids=["generator", "map", "iterator"],
)
def test_depends_on_given_as_an_iterator_is_sent_in_full_every_time(given: Any):
    """``depends_on=(t.id for t in parents)`` (or ``map(...)``) sends every id, in order. The
    iterator is read once, when the request is made, so sending the same request again with
    the same key (after a TransportError) sends the same ids, not an empty list."""
    recorder = Recorder(ok({"deduplicated": False, "task": TASK_SUMMARY}))
    submit = request(depends_on=given([PARENT_A, PARENT_B]))
    client = client_for(recorder)
    client.submit_task("k", submit)
    client.submit_task("k", submit)
    assert [recorder.body(n)["depends_on"] for n in (0, 1)] == [[PARENT_A, PARENT_B]] * 2


@pytest.mark.parametrize("depends_on", [42, 4.2, {PARENT_A: PARENT_B}], ids=repr)
def test_depends_on_that_is_not_an_iterable_of_ids_is_a_type_error_naming_it(depends_on: Any):
    recorder = Recorder(ok({}))
    with pytest.raises(TypeError, match="depends_on must be a list of task ids"):
        client_for(recorder).submit_task("k", request(depends_on=depends_on))
    assert recorder.requests == []


def test_batch_items_carry_their_ref_and_later_items_name_it():
    recorder = Recorder(ok(accepted("split", "part-1", "join")))
    split = BatchItem("split", request(), ref="split")
    part = BatchItem("part-1", request(depends_on=[split.depends_on_ref]), ref="part.1")
    join = BatchItem("join", request(depends_on=[part.depends_on_ref, PARENT_A], on_dependency_failure="CANCEL"))
    results = client_for(recorder).submit_tasks([split, part, join])
    assert [result.accepted for result in results] == [True, True, True]
    assert recorder.body() == {
        "tasks": [
            {"idempotency_key": "split", "ref": "split", "task": request().to_json()},
            {
                "idempotency_key": "part-1",
                "ref": "part.1",
                "task": {**request().to_json(), "depends_on": ["ref:split"]},
            },
            {
                "idempotency_key": "join",
                "task": {
                    **request().to_json(),
                    "depends_on": ["ref:part.1", PARENT_A],
                    "on_dependency_failure": "CANCEL",
                },
            },
        ]
    }


def test_pairs_and_batch_items_mix_in_one_batch():
    recorder = Recorder(ok(accepted("a", "b")))
    client_for(recorder).submit_tasks([("a", request()), BatchItem("b", request(), ref="b")])
    assert [entry.get("ref") for entry in recorder.body()["tasks"]] == [None, "b"]


@pytest.mark.parametrize("ref", ["", "x" * 65, "has space", "ref:a", "ü"])
def test_a_ref_the_server_would_refuse_is_refused_when_the_item_is_made(ref: str):
    with pytest.raises(ValueError, match="ref must be 1-64"):
        BatchItem("k", request(), ref=ref)


def test_a_ref_given_twice_is_refused_before_sending():
    recorder = Recorder(ok(accepted("a", "b")))
    with pytest.raises(ValueError, match="ref 'same' given twice"):
        client_for(recorder).submit_tasks(
            [BatchItem("a", request(), ref="same"), BatchItem("b", request(), ref="same")]
        )
    assert recorder.requests == []


def test_an_item_without_a_ref_cannot_be_named():
    with pytest.raises(ValueError, match="has no ref"):
        _ = BatchItem("k", request()).depends_on_ref


# --------------------------------------------------------------------------- the task


def test_a_blocked_task_reads_its_depends_on_and_failure_rule():
    task = Task.from_json(
        {**TASK_SUMMARY, "state": "BLOCKED", "depends_on": [PARENT_A, PARENT_B], "on_dependency_failure": "RUN"}
    )
    assert (task.state, task.depends_on, task.on_dependency_failure) == ("BLOCKED", (PARENT_A, PARENT_B), "RUN")


def test_a_task_without_dependencies_reads_an_empty_depends_on():
    task = Task.from_json(TASK_SUMMARY)
    assert task.depends_on == () and task.on_dependency_failure is None


@pytest.mark.parametrize("depends_on", [PARENT_A, [PARENT_A, 1], {"0": PARENT_A}])
def test_a_depends_on_that_is_not_a_list_of_strings_is_a_protocol_error(depends_on: Any):
    with pytest.raises(ProtocolError, match="task.depends_on"):
        Task.from_json({**TASK_SUMMARY, "depends_on": depends_on})


# --------------------------------------------------------------------------- reads

LINKS = {
    "items": [
        {
            "id": PARENT_A,
            "queue_id": QUEUE_ID,
            "handler": "report.part",
            "business_key": "report/7",
            "state": "SUCCEEDED",
            "created_at": "2026-11-29T20:00:00Z",
            "updated_at": "2026-11-29T20:00:01Z",
            "finished_at": "2026-11-29T20:00:01Z",
        },
        {"id": PARENT_B},
        {"id": "c" * 32, "pruned": True},
    ],
    "next_page_token": "2",
}


@pytest.mark.parametrize("verb", ["list_dependencies", "list_dependents"])
def test_the_relation_reads_page_like_the_other_lists(verb: str):
    recorder = Recorder(ok(LINKS))
    page = getattr(client_for(recorder), verb)(TASK_ID, page_size=3, page_token="tok")
    (sent,) = recorder.requests
    path = verb.removeprefix("list_")
    assert (sent.method, str(sent.url)) == (
        "GET",
        f"http://orbit.test/v1/tasks/{TASK_ID}/{path}?page_size=3&page_token=tok",
    )
    readable, hidden, pruned = page.items
    assert readable == TaskLink(
        id=PARENT_A,
        queue_id=QUEUE_ID,
        handler="report.part",
        state="SUCCEEDED",
        business_key="report/7",
        created_at=datetime.datetime(2026, 11, 29, 20, 0, tzinfo=datetime.UTC),
        updated_at=datetime.datetime(2026, 11, 29, 20, 0, 1, tzinfo=datetime.UTC),
        finished_at=datetime.datetime(2026, 11, 29, 20, 0, 1, tzinfo=datetime.UTC),
    )
    assert hidden == TaskLink(id=PARENT_B) and hidden.state is None and not hidden.pruned
    assert pruned.id == "c" * 32 and pruned.pruned
    assert page.next_page_token == "2"


def test_a_link_without_an_id_is_a_protocol_error():
    client = client_for(Recorder(ok({"items": [{"state": "SUCCEEDED"}]})))
    with pytest.raises(ProtocolError, match="task link.id"):
        client.list_dependencies(TASK_ID)


# --------------------------------------------------------------------------- the worker's side

TASK = {"id": TASK_ID, "queue_id": QUEUE_ID, "handler": "report.join", "handler_version": "v1", "payload_version": "v1"}


def assignment(**extra: Any) -> dict[str, Any]:
    return {"attempt_id": "a1", "epoch": 1, "task": {**TASK, "payload": {}, "priority": 5}, **extra}


def execution_of(frame: dict[str, Any]) -> Execution:
    worker = orbit_sdk.Worker("http://h", "t", [QUEUE_ID], {"report.join": lambda e: None})
    return Execution(worker, parse_assignment(frame, concurrency_keys=True), 1, None)


def test_the_assignments_dependencies_reach_the_execution_in_order():
    run = execution_of(
        assignment(
            dependencies=[
                {"task_id": PARENT_A, "state": "SUCCEEDED", "output": {"sum": 55}},
                {"task_id": PARENT_B, "state": "FAILED"},
                {"task_id": "c" * 32},
            ]
        )
    )
    assert run.dependencies == (
        Dependency(PARENT_A, "SUCCEEDED", {"sum": 55}),
        Dependency(PARENT_B, "FAILED", None),
        Dependency("c" * 32, None, None),  # the server could no longer read it
    )


def test_a_task_without_dependencies_has_none():
    assert execution_of(assignment()).dependencies == ()


@pytest.mark.parametrize(
    ("dependencies", "match"),
    [
        ({"task_id": PARENT_A}, "assignment.dependencies: expected a list"),
        ([PARENT_A], r"assignment.dependencies\[0\]: expected a JSON object"),
        ([{"state": "SUCCEEDED"}], r"assignment.dependencies\[0\].task_id: missing"),
        ([{"task_id": PARENT_A, "state": 3}], r"assignment.dependencies\[0\].state: expected a string"),
    ],
)
def test_dependencies_that_break_the_contract_are_a_protocol_error(dependencies: Any, match: str):
    with pytest.raises(ProtocolError, match=match):
        parse_assignment(assignment(dependencies=dependencies), concurrency_keys=True)

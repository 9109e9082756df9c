"""Rounds (tasks.actions.rounds): many submits, results, starts and leases in
one transaction, each answered exactly as its single verb would answer it."""

from __future__ import annotations

import time

import pytest

from orbit.db import groupcommit
from orbit.errors import (
    IdempotencyConflict,
    InvalidArgument,
    LeaseLost,
    NotFound,
    QueueFull,
    StateConflict,
    Unavailable,
)
from orbit.fields import new_id
from orbit.models import Credential, IdempotencyRecord
from orbit.principal import Actor, authenticate_token, known_credential
from orbit.tenancy import revoke_credential
from tasks.actions import batch, rounds
from tasks.actions.batch import Submission
from tasks.actions.dispatch import LeaseOutcome, StartRequest
from tasks.actions.endings import ResultReport
from tasks.actions.rounds import CredentialNotConfirmed, LeaseRequest, SubmitRequest, run_round
from tasks.models import Attempt, ConcurrencyKey, Task
from tests.support.api import make_queue
from tests.support.factories import make_credential
from tests.support.tasks import assert_invariants, submit_ok, task_body, worker_for

pytestmark = pytest.mark.django_db


def report(worker, assignment, outcome="SUCCEEDED", retryable=False):
    return ResultReport(worker, assignment["attempt_id"], assignment["epoch"], outcome, retryable, {"ok": 1}, None)


def test_one_round_leases_for_several_workers_each_within_its_limit(tenant):
    queue = make_queue(tenant.client, "many", max_concurrency=50, rate_per_second=1000)
    for n in range(10):
        submit_ok(tenant.client, queue["id"], f"t{n}")
    workers = [worker_for(tenant, queue["id"], worker_id=f"w{n}") for n in range(3)]

    answers = run_round([LeaseRequest(workers[0], 3), LeaseRequest(workers[1], 4), LeaseRequest(workers[2], 16)])

    assert [len(answer.assignments) for answer in answers] == [3, 4, 3]
    task_ids = [entry["task"]["id"] for answer in answers for entry in answer.assignments]
    assert len(set(task_ids)) == 10
    for worker, answer in zip(workers, answers, strict=True):
        attempt_ids = [entry["attempt_id"] for entry in answer.assignments]
        assert set(Attempt.objects.filter(id__in=attempt_ids).values_list("worker_id", flat=True)) == {worker.worker_id}
    assert_invariants()


def test_a_hand_off_that_starts_ahead_is_served_before_the_leases_beside_it(tenant):
    # given a key with two tasks, the first running on one worker, and another worker of that kind
    queue = make_queue(tenant.client, "ahead-first", max_concurrency=50, rate_per_second=1000)
    for n in range(2):
        submit_ok(tenant.client, queue["id"], f"a{n}", concurrency_key="object/1")
    holder, other = (worker_for(tenant, queue["id"], worker_id=name) for name in ("holder", "other"))
    (first,) = rounds.lease_tasks(worker=holder, limit=1)
    rounds.approve_start(worker=holder, attempt_id=first["attempt_id"], epoch=first["epoch"])
    # when one round holds the other's lease, then the holder's result with its hand-off
    result = report(holder, first)
    hand_off = LeaseRequest(holder, 1, after=result, start_ahead=("echo", "v1"))
    answers = run_round([LeaseRequest(other, 16), result, hand_off])
    # then the released key goes on with the result that asked for its next Start, started
    assert answers[0].assignments == []
    (handed,) = answers[2].assignments
    assert handed["task"]["concurrency_key"] == "object/1" and handed["state"] == "RUNNING"
    assert_invariants()


def test_workers_of_one_kind_never_share_a_key_in_one_round(tenant):
    queue = make_queue(tenant.client, "keys", max_concurrency=50, rate_per_second=1000)
    for n in range(6):
        submit_ok(tenant.client, queue["id"], f"k{n}", concurrency_key=f"object/{n % 2}")
    workers = [worker_for(tenant, queue["id"], worker_id=f"w{n}") for n in range(3)]

    answers = run_round([LeaseRequest(worker, 16) for worker in workers])

    keys = [entry["task"]["concurrency_key"] for answer in answers for entry in answer.assignments]
    assert sorted(keys) == ["object/0", "object/1"]
    holders = ConcurrencyKey.objects.filter(key__in=keys).values_list("holder_attempt_id", flat=True)
    assert all(holders)
    assert_invariants()


def test_a_mixed_round_answers_each_request_as_its_single_verb_would(tenant):
    queue = make_queue(tenant.client, "mixed", max_concurrency=4, rate_per_second=1000)
    for n in range(6):
        submit_ok(tenant.client, queue["id"], f"m{n}")
    worker = worker_for(tenant, queue["id"])
    other = worker_for(tenant, queue["id"], worker_id="other")
    first = rounds.lease_tasks(worker=worker, limit=4)
    for entry in first[:2]:
        rounds.approve_start(worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"])
    running, leased = first[:2], first[2:]

    items = [
        report(worker, running[0]),
        report(worker, running[1], outcome="FAILED"),
        report(worker, running[0]),  # a replay in the same round
        report(worker, leased[0]),  # not started yet
        StartRequest(worker, leased[0]["attempt_id"], leased[0]["epoch"]),
        StartRequest(worker, leased[0]["attempt_id"], leased[0]["epoch"]),  # twice
        StartRequest(worker, leased[1]["attempt_id"], leased[1]["epoch"] + 1),  # wrong epoch
        StartRequest(other, leased[1]["attempt_id"], leased[1]["epoch"]),  # not its attempt
        LeaseRequest(other, 16),
    ]
    answers = run_round(items)

    assert answers[0] == {"task_state": "SUCCEEDED", "duplicate": False, "late": False}
    assert answers[1] == {"task_state": "FAILED", "duplicate": False, "late": False}
    assert answers[2] == {"task_state": "SUCCEEDED", "duplicate": True, "late": False}
    assert isinstance(answers[3], StateConflict)
    assert answers[4]["attempt_number"] == 1 and answers[5] == answers[4]
    assert isinstance(answers[6], LeaseLost) and isinstance(answers[7], LeaseLost)
    # The two results freed two of the queue's four permits; the lease took them.
    assert isinstance(answers[8], LeaseOutcome) and len(answers[8].assignments) == 2
    assert Task.objects.get(id=running[0]["task"]["id"]).output == {"ok": 1}
    assert Attempt.objects.get(id=running[1]["attempt_id"]).state == "FAILED"
    assert Attempt.objects.get(id=leased[0]["attempt_id"]).state == "RUNNING"
    assert Attempt.objects.get(id=leased[1]["attempt_id"]).state == "LEASED"
    assert_invariants()


def submitter(tenant, token: str | None = None) -> Actor:
    return Actor(principal=authenticate_token(token or tenant.token), request_id=new_id())


def submission(queue_id: str, key: str, **overrides) -> Submission:
    return Submission(key=key, body=task_body(queue_id, **overrides), request_id=new_id())


def test_a_round_admits_its_submits_and_can_lease_them_at_once(tenant):
    queue = make_queue(tenant.client, "submits", max_concurrency=50, rate_per_second=1000)
    actor, worker = submitter(tenant), worker_for(tenant, queue["id"])

    answers = run_round(
        [
            SubmitRequest(actor, submission(queue["id"], "s1")),
            SubmitRequest(actor, submission(queue["id"], "s2")),
            LeaseRequest(worker, 16),
        ]
    )

    assert [answer.status for answer in answers[:2]] == [201, 201]
    submitted = {answer.data["task"]["id"] for answer in answers[:2]}
    assert {entry["task"]["id"] for entry in answers[2].assignments} == submitted
    assert set(Task.objects.filter(id__in=submitted).values_list("state", flat=True)) == {"LEASED"}
    assert_invariants()


def test_a_submit_whose_caller_gave_up_before_the_transaction_is_not_committed(tenant):
    # A process stopped between a round's first reads and its transaction wakes with the
    # caller already answered 503 by its timer: that submit must not be committed then.
    queue = make_queue(tenant.client, "late", max_concurrency=50, rate_per_second=1000)
    actor = submitter(tenant)
    given_up = SubmitRequest(actor, submission(queue["id"], "given-up"), deadline=time.monotonic() - 0.001)
    waited = SubmitRequest(actor, submission(queue["id"], "waited"))

    answers = run_round([given_up, waited])

    assert isinstance(answers[0], Unavailable) and answers[1].status == 201
    assert list(Task.objects.filter(queue_id=queue["id"]).values_list("id", flat=True)) == [
        answers[1].data["task"]["id"]
    ]
    assert not IdempotencyRecord.objects.filter(key="given-up").exists()
    # The caller's retry with the same key is decided afresh.
    assert run_round([SubmitRequest(actor, submission(queue["id"], "given-up"))])[0].status == 201
    assert_invariants()


def test_a_submit_on_a_known_credential_is_decided_only_if_its_row_still_grants_it(tenant):
    queue = make_queue(tenant.client, "known", max_concurrency=50, rate_per_second=1000)
    revoked = make_credential(tenant.namespace)
    narrowed = make_credential(tenant.namespace)
    actors = {}
    for name, issued in (("live", tenant), ("revoked", revoked), ("narrowed", narrowed)):
        actors[name] = submitter(tenant, issued.token)  # authenticated once: now known to this process
    known = {
        name: known_credential(issued.token)
        for name, issued in (("live", tenant), ("revoked", revoked), ("narrowed", narrowed))
    }
    assert all(minted is not None for minted in known.values())
    revoke_credential(revoked.credential.id)
    Credential.objects.filter(id=narrowed.credential.id).update(scopes=["tasks:read"])

    answers = run_round(
        [
            SubmitRequest(actors[name], submission(queue["id"], name), credential_to_confirm=known[name])
            for name in ("revoked", "live", "narrowed")
        ]
    )

    declined, accepted, changed = answers
    assert isinstance(declined, CredentialNotConfirmed) and isinstance(changed, CredentialNotConfirmed)
    assert accepted.status == 201
    assert Task.objects.filter(queue_id=queue["id"]).count() == 1
    assert not IdempotencyRecord.objects.filter(key__in=["revoked", "narrowed"]).exists()
    assert_invariants()


def test_twins_and_other_callers_in_one_round_get_their_single_submit_answers(tenant):
    queue = make_queue(tenant.client, "twins", max_unfinished_tasks=3)
    actor = submitter(tenant)
    other = submitter(tenant, make_credential(tenant.namespace).token)
    body = submission(queue["id"], "same")

    answers = run_round(
        [
            SubmitRequest(actor, body),
            SubmitRequest(actor, Submission(key="same", body=body.body, request_id=new_id())),  # a replay
            SubmitRequest(actor, submission(queue["id"], "same", priority=1)),  # the key, another request
            SubmitRequest(other, submission(queue["id"], "other")),  # another credential
            SubmitRequest(actor, submission(queue["id"], "third")),
            SubmitRequest(actor, submission(queue["id"], "fourth")),  # one of four is over max_unfinished_tasks
            SubmitRequest(actor, submission("0" * 32, "nowhere")),
        ]
    )

    first, replay, conflict, by_other, third, fourth, nowhere = answers
    assert first.status == 201 and first.data["deduplicated"] is False
    assert replay.status == 200 and replay.data["deduplicated"] is True
    assert replay.data["task"]["id"] == first.data["task"]["id"]
    assert isinstance(conflict, IdempotencyConflict)
    assert isinstance(nowhere, NotFound)
    # concurrent submits may be admitted in either order: exactly one of the last three is refused
    new = [by_other, third, fourth]
    assert sum(isinstance(answer, QueueFull) for answer in new) == 1
    assert sorted(answer.status for answer in new if not isinstance(answer, QueueFull)) == [201, 201]
    assert Task.objects.filter(queue_id=queue["id"]).count() == 3
    assert IdempotencyRecord.objects.filter(namespace_id=tenant.namespace_id).exclude(key="create-twins").count() == 3
    assert_invariants()


def test_a_twin_committed_first_elsewhere_sends_the_round_again_without_its_submits(tenant, monkeypatch):
    queue = make_queue(tenant.client, "raced", max_concurrency=50, rate_per_second=1000)
    submit_ok(tenant.client, queue["id"], "waiting")
    actor, worker = submitter(tenant), worker_for(tenant, queue["id"])
    raced = submission(queue["id"], "raced")
    twin_receipt = {"deduplicated": False, "task": {"id": "t" * 32}}
    read_first = rounds._FirstReads.read

    def twin_commits_first(items, mine):
        # After the round's unlocked first reads, before its transaction.
        first = read_first(items, mine)
        IdempotencyRecord.objects.create(
            namespace_id=tenant.namespace_id,
            key="raced",
            operation="task.submit",
            digest=batch.digests_of([raced])[0],
            response_status=201,
            response_data=twin_receipt,
            request_id=new_id(),
        )
        monkeypatch.setattr(rounds._FirstReads, "read", read_first)
        return first

    monkeypatch.setattr(rounds._FirstReads, "read", staticmethod(twin_commits_first))

    submitted, leased = run_round([SubmitRequest(actor, raced), LeaseRequest(worker, 16)])

    assert submitted.status == 200 and submitted.data == {**twin_receipt, "deduplicated": True}
    assert len(leased.assignments) == 1  # the round was decided again, without the submit
    assert not Task.objects.filter(queue_id=queue["id"], state="WAITING").exists()
    assert Task.objects.filter(queue_id=queue["id"]).count() == 1
    assert_invariants()


def test_a_body_checked_in_advance_is_judged_only_after_its_key(tenant):
    queue = make_queue(tenant.client, "checked")
    actor = submitter(tenant)
    submit_ok(tenant.client, queue["id"], "used")
    invalid = task_body(queue["id"], priority="high")

    reused, fresh = run_round(
        [
            SubmitRequest(actor, batch.checked_submission(actor, "used", invalid)),
            SubmitRequest(actor, batch.checked_submission(actor, "fresh", invalid)),
        ]
    )

    assert isinstance(reused, IdempotencyConflict)  # the key is judged first, as for any submit
    assert isinstance(fresh, InvalidArgument) and fresh.message.startswith("priority")
    assert not IdempotencyRecord.objects.filter(key="fresh").exists()


def test_finished_attempts_are_counted_by_state_once_each(tenant):
    from prometheus_client import REGISTRY

    def finished(state: str) -> float:
        return REGISTRY.get_sample_value("orbit_attempts_finished_total", {"state": state}) or 0.0

    queue = make_queue(tenant.client, "counted", max_concurrency=4, rate_per_second=1000)
    for n in range(3):
        submit_ok(tenant.client, queue["id"], f"c{n}")
    worker = worker_for(tenant, queue["id"])
    leased = rounds.lease_tasks(worker=worker, limit=3)
    for entry in leased:
        rounds.approve_start(worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"])
    before = {state: finished(state) for state in ("SUCCEEDED", "FAILED")}

    run_round([report(worker, leased[0]), report(worker, leased[1]), report(worker, leased[2], outcome="FAILED")])
    run_round([report(worker, leased[0])])  # a replay counts nothing

    assert finished("SUCCEEDED") - before["SUCCEEDED"] == 2
    assert finished("FAILED") - before["FAILED"] == 1


def locking_statements(captured) -> list[str]:
    return [query["sql"] for query in captured.captured_queries if "FOR UPDATE" in query["sql"]]


@pytest.mark.mysql_only
@pytest.mark.parametrize("keyed", [False, True])
def test_reports_and_starts_lock_their_rows_with_the_counters_key_rows_before_tasks(
    tenant, keyed, django_assert_max_num_queries
):
    queue = make_queue(tenant.client, "ahead", max_concurrency=8, rate_per_second=1000)
    for n in range(2):
        submit_ok(tenant.client, queue["id"], f"a{n}", **({"concurrency_key": f"object/{n}"} if keyed else {}))
    worker = worker_for(tenant, queue["id"])
    running, leased = rounds.lease_tasks(worker=worker, limit=2)
    rounds.approve_start(worker=worker, attempt_id=running["attempt_id"], epoch=running["epoch"])

    with django_assert_max_num_queries(20) as captured:
        answers = run_round([report(worker, running), StartRequest(worker, leased["attempt_id"], leased["epoch"])])

    assert answers[0]["task_state"] == "SUCCEEDED" and answers[1]["attempt_number"] == 1
    # one round trip for every lock of the round, in the global order (a keyed
    # result's key row before the tasks)
    counters, *later = locking_statements(captured)
    assert later == []
    tables = ["orbit_application_state", *(["orbit_concurrency_key"] if keyed else []), "orbit_task", "orbit_attempt"]
    positions = [counters.index(f"FROM `{table}`") for table in tables]
    assert positions == sorted(positions)
    assert ("FROM `orbit_concurrency_key`" in counters) is keyed
    assert_invariants()


def test_the_lane_knows_a_hand_off_and_the_start_that_follows_it(tenant):
    """A result put in the lane with its worker's lease (the hand-off) is
    answered with the next assignment, whose Start the worker sends at once
    (orbit.db.groupcommit keeps such a crowd's phases in step); a result or a
    lease alone is neither."""
    queue = make_queue(tenant.client, "phases")
    worker = worker_for(tenant, queue["id"])
    assignment = {"attempt_id": new_id(), "epoch": 1}
    phase = rounds.ROUNDS.phase
    assert phase([report(worker, assignment), LeaseRequest(worker, 1)]) == groupcommit.HAND_ON
    assert phase([StartRequest(worker, assignment["attempt_id"], 1)]) == groupcommit.NEXT
    assert phase([report(worker, assignment)]) is None
    assert phase([LeaseRequest(worker, 4)]) is None


def test_a_round_of_payloads_and_outputs_over_the_servers_packet_limit_is_decided_whole(tenant):
    # given forty submits of payloads near the 256 KiB limit, each character one the
    # database escapes (a task row and its idempotency answer hold it twice: about 38 MiB
    # of statements, over MariaDB's 16 MiB max_allowed_packet), and sixteen running tasks
    # whose results carry 400 KB outputs of the same kind
    queue = make_queue(tenant.client, "large", max_concurrency=50, rate_per_second=1000, max_unfinished_tasks=1000)
    actor, worker = submitter(tenant), worker_for(tenant, queue["id"])
    for n in range(16):
        submit_ok(tenant.client, queue["id"], f"running-{n}")
    running = rounds.lease_tasks(worker=worker, limit=16)
    for entry in running:
        rounds.approve_start(worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"])
    payload = '"' * 120_000  # 240,002 bytes as JSON
    outputs = [{"n": n, "text": "'\\" * 200_000} for n in range(16)]

    # when they are decided in one round
    answers = run_round(
        [SubmitRequest(actor, submission(queue["id"], f"large-{n}", payload=payload)) for n in range(40)]
        + [
            ResultReport(worker, entry["attempt_id"], entry["epoch"], "SUCCEEDED", False, output, None)
            for entry, output in zip(running, outputs, strict=True)
        ]
    )

    # then every submit is accepted and every result recorded, each with its own value
    assert [answer.status for answer in answers[:40]] == [201] * 40
    assert not [answer for answer in answers[40:] if isinstance(answer, Exception)]
    submitted = [answer.data["task"]["id"] for answer in answers[:40]]
    assert Task.objects.filter(id__in=submitted, payload=payload).count() == 40
    for entry, output in zip(running, outputs, strict=True):
        assert Task.objects.get(id=entry["task"]["id"]).output == output
    assert_invariants()

"""The hand-written fast paths of orbit.db (the backend's literal, datetime
and commit shortcuts; rows' joined statements), against MariaDB: values an API caller or a worker controls reach the
database as exactly the bytes sent, datetimes as the right UTC instant, and
a joined batch that fails commits nothing and leaves the connection usable."""

from __future__ import annotations

import datetime
import itertools
import json
import unicodedata
import zoneinfo

import pytest
from django.db import DataError, IntegrityError, connection
from django.test import override_settings

from orbit.db.rows import atomic_sent_together, insert_rows, new_row, select_together, update_by_pk, update_each_by_pk
from orbit.models import Event, IdempotencyRecord
from tasks.actions import rounds
from tasks.actions.endings import ResultReport
from tasks.actions.rounds import run_round
from tasks.models import Attempt, ConcurrencyKey, Task
from tests.conftest import post_json
from tests.support.api import assert_ok, make_queue
from tests.support.other_connection import other_cursor
from tests.support.tasks import get_task, submit_ok, task_body, worker_for

pytestmark = [pytest.mark.mysql_only]

SEQ = itertools.count(1)

# Strings that would end a literal, or start another statement, or be
# %-formatted a second time, or fold into one another under a lax collation.
HOSTILE = [
    "'",
    "''",
    "\\",
    "\\'",
    "'\\",
    "a\x00b",
    "\x1a",
    "\n\r\t",
    "'; DROP TABLE orbit_event; --",
    '"; SELECT 1; --',
    "\\'; SELECT SLEEP(5); #",
    "%s",
    "%%",
    "%(x)s",
    "%",
    "😀",
    "𝔘",
    "ß",
    "ss",
    "a",
    "A",
    "a ",
    " a",
    "é",  # NFC
    unicodedata.normalize("NFD", "é"),
    "\u2028",
    "\ufeff",
    "x" * 255,
    "€" * 255,
    "😀" * 255,
]


def record(namespace_id: str, key: str) -> IdempotencyRecord:
    return new_row(
        IdempotencyRecord,
        namespace_id=namespace_id,
        key=key,
        operation="audit",
        digest="d",
        response_status=0,
        response_data={},
        request_id="r" * 32,
    )


def stored_keys(namespace_id: str) -> dict[str, str]:
    """Each row's key, decoded from the bytes the server holds, and its operation."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT HEX(`key`), HEX(operation) FROM orbit_idempotency_record WHERE namespace_id = %s", [namespace_id]
        )
        return {bytes.fromhex(key).decode(): bytes.fromhex(op).decode() for key, op in cursor.fetchall()}


def committed_keys(namespace_id: str) -> list[str]:
    """What another connection sees: only committed rows."""
    with other_cursor() as cursor:
        cursor.execute("SELECT `key` FROM orbit_idempotency_record WHERE namespace_id = %s", [namespace_id])
        return sorted(key for (key,) in cursor.fetchall())


# --- literals, byte for byte ---------------------------------------


@pytest.mark.django_db(transaction=True)
def test_hostile_strings_are_written_and_matched_byte_for_byte_by_every_write_path():
    namespace_id = "h" * 32
    with atomic_sent_together():
        insert_rows([record(namespace_id, key) for key in HOSTILE])
    assert set(stored_keys(namespace_id)) == set(HOSTILE)
    ids = dict(IdempotencyRecord.objects.filter(namespace_id=namespace_id).values_list("key", "id"))
    assert set(ids) == set(HOSTILE)  # no two folded into one, none padded away

    with atomic_sent_together():
        for key, pk in ids.items():
            update_by_pk(IdempotencyRecord, [pk], {"operation": key[:64]})
    assert stored_keys(namespace_id) == {key: key[:64] for key in HOSTILE}

    with atomic_sent_together():
        update_each_by_pk(
            IdempotencyRecord,
            {pk: {"operation": ("E" + key)[:64], "response_data": {"k": key}} for key, pk in ids.items()},
        )
    assert stored_keys(namespace_id) == {key: ("E" + key)[:64] for key in HOSTILE}
    rows = {row.key: row.response_data for row in IdempotencyRecord.objects.filter(namespace_id=namespace_id)}
    assert rows == {key: {"k": key} for key in HOSTILE}
    for key in HOSTILE:
        assert IdempotencyRecord.objects.filter(namespace_id=namespace_id, key=key).count() == 1, repr(key)
    assert Event.objects.filter(namespace_id=namespace_id).count() == 0  # the table is still there


@pytest.mark.django_db(transaction=True)
def test_a_lone_surrogate_is_refused_before_anything_is_sent():
    with pytest.raises(UnicodeEncodeError):
        insert_rows([record("s" * 32, "\ud800")])
    assert not IdempotencyRecord.objects.filter(namespace_id="s" * 32).exists()


@pytest.mark.django_db
def test_hostile_values_submitted_over_the_api_come_back_unchanged(tenant):
    queue = make_queue(tenant.client, "hostile")
    payload = {"text": HOSTILE, "nested": {"'": "\\", "%s": "%%"}, "n": [1, 1.0, True, None]}
    keys = [key for key in HOSTILE if key.strip() == key and "\x00" not in key and key.isprintable()][:20]
    submitted = {}
    for n, key in enumerate(keys):
        body = task_body(queue["id"], payload=payload, business_key=key, concurrency_key=key, fairness_key=key)
        idempotency_key = f"k'\\%s; DROP TABLE orbit_event; -- {n}"
        submitted[key] = assert_ok(post_json(tenant.client, "/v1/tasks", body, key=idempotency_key), 201)["task"]
    batch = post_json(
        tenant.client,
        "/v1/tasks:batch",
        {
            "tasks": [
                {"idempotency_key": f"b'\\{n}%s", "task": task_body(queue["id"], payload=payload)} for n in range(3)
            ]
        },
    )
    assert all(result["status"] == 201 for result in assert_ok(batch)["results"])

    for key, task in submitted.items():
        shown = get_task(tenant.client, task["id"])
        assert shown["payload"] == payload
        row = Task.objects.get(id=task["id"])
        assert (row.business_key, row.concurrency_key, row.fairness_key) == (key, key, key)
        # compared byte for byte: nothing folded into it (ß/ss, a/A, NFC/NFD, a trailing space)
        assert list(Task.objects.filter(queue_id=queue["id"], concurrency_key=key).values_list("id", flat=True)) == [
            task["id"]
        ]
    assert IdempotencyRecord.objects.filter(namespace_id=tenant.namespace_id, key__startswith="k'\\%s").count() == len(
        keys
    )


# --- update_each_by_pk: a value "shared" by every row -----------------------

# Equal in Python, different JSON: 1 == True == 1.0, 0.0 == -0.0.
EQUAL_BUT_DIFFERENT = [
    ({"ok": 1}, {"ok": True}),
    ({"v": 1}, {"v": 1.0}),
    ([0], [False]),
    ({"a": 0.0}, {"a": -0.0}),
    ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
]


@pytest.mark.django_db
@pytest.mark.parametrize("outputs", EQUAL_BUT_DIFFERENT, ids=repr)
def test_values_equal_in_python_but_written_differently_are_each_rows_own(tenant, outputs):
    queue = make_queue(tenant.client, "each")
    ids = [submit_ok(tenant.client, queue["id"], f"each-{n}")["id"] for n in range(2)]
    update_each_by_pk(Task, {ids[0]: {"output": outputs[0]}, ids[1]: {"output": outputs[1]}})
    rows = Task.objects.in_bulk(ids)
    assert [json.dumps(rows[task_id].output) for task_id in ids] == [json.dumps(output) for output in outputs]


@pytest.mark.django_db
def test_two_workers_results_in_one_round_keep_their_own_outputs(tenant):
    # given two running tasks
    queue = make_queue(tenant.client, "outputs", max_concurrency=4, rate_per_second=1000)
    for n in range(2):
        submit_ok(tenant.client, queue["id"], f"out-{n}")
    worker = worker_for(tenant, queue["id"])
    leased = rounds.lease_tasks(worker=worker, limit=2)
    for entry in leased:
        rounds.approve_start(worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"])

    # when their results, {"ok": 1} and {"ok": true}, are decided in one round
    outputs = [{"ok": 1}, {"ok": True}]
    run_round(
        [
            ResultReport(worker, entry["attempt_id"], entry["epoch"], "SUCCEEDED", False, output, None)
            for entry, output in zip(leased, outputs, strict=True)
        ]
    )

    # then each task and attempt shows the output its worker sent
    for entry, output in zip(leased, outputs, strict=True):
        assert json.dumps(get_task(tenant.client, entry["task"]["id"])["output"]) == json.dumps(output)
        assert json.dumps(Attempt.objects.get(id=entry["attempt_id"]).output) == json.dumps(output)


# --- datetimes -----------------------------------------------------------

INSTANT = datetime.datetime(2026, 3, 8, 1, 2, 3, 456789, tzinfo=datetime.UTC)


@pytest.mark.django_db(transaction=True)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a naive datetime, as Django warns
@pytest.mark.parametrize("time_zone", ["UTC", "Asia/Shanghai", "America/New_York"])
@pytest.mark.parametrize("form", ["utc", "+08:00", "zoneinfo", "naive in TIME_ZONE"])
def test_datetimes_are_written_as_their_utc_instant_with_microseconds(time_zone, form):
    with override_settings(TIME_ZONE=time_zone):
        connection.close()
        value = {
            "utc": INSTANT,
            "+08:00": INSTANT.astimezone(datetime.timezone(datetime.timedelta(hours=8))),
            "zoneinfo": INSTANT.astimezone(zoneinfo.ZoneInfo("Europe/Paris")),
            "naive in TIME_ZONE": INSTANT.astimezone(zoneinfo.ZoneInfo(time_zone)).replace(tzinfo=None),
        }[form]
        namespace_id = "d" * 32
        with atomic_sent_together():
            insert_rows(
                [new_row(ConcurrencyKey, namespace_id=namespace_id, key=f"k{n}", updated_at=value) for n in range(2)]
            )
        ids = list(ConcurrencyKey.objects.filter(namespace_id=namespace_id).values_list("id", flat=True))
        with atomic_sent_together():
            update_by_pk(ConcurrencyKey, ids, {"rate_tat": value})
            update_each_by_pk(ConcurrencyKey, {ids[0]: {"next_start_at": value}, ids[1]: {"next_start_at": INSTANT}})
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT CAST(updated_at AS CHAR), CAST(rate_tat AS CHAR), CAST(next_start_at AS CHAR)"
                " FROM orbit_concurrency_key WHERE namespace_id = %s",
                [namespace_id],
            )
            texts = {text for row in cursor.fetchall() for text in row}
        read = ConcurrencyKey.objects.filter(namespace_id=namespace_id)
        assert {row.rate_tat for row in read} == {INSTANT}
    connection.close()
    assert texts == {"2026-03-08 01:02:03.456789"}


# --- a joined batch that fails ---------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sent_with", ["commit", "orm select", "select_together"])
@pytest.mark.parametrize("failure", ["too long", "duplicate", "null"])
def test_a_failure_in_the_middle_of_a_joined_batch_commits_nothing_and_the_connection_goes_on(sent_with, failure):
    namespace_id = "j" * 32
    insert_rows([record(namespace_id, "taken")])
    failing = {
        "too long": record(namespace_id, "x" * 300),
        "duplicate": record(namespace_id, "taken"),
        "null": record(namespace_id, "null"),
    }[failure]
    if failure == "null":
        failing.operation = None  # type: ignore[assignment]
    with pytest.raises((DataError, IntegrityError)), atomic_sent_together():
        insert_rows([record(namespace_id, "before")])
        update_by_pk(IdempotencyRecord, [0], {"digest": "z"})
        insert_rows([failing])
        insert_rows([record(namespace_id, "after")])
        if sent_with == "orm select":
            list(Task.objects.filter(id="0" * 32))
        elif sent_with == "select_together":
            select_together([(Task, "id = %s", ["0" * 32]), (Event, "id = %s", [0])], lock=True)
    assert connection.commit_sent is False
    assert committed_keys(namespace_id) == ["taken"]  # nothing half-written
    # no result left unread (error 2014): the connection answers the next request
    assert list(IdempotencyRecord.objects.filter(namespace_id=namespace_id).values_list("key", flat=True)) == ["taken"]
    with atomic_sent_together():
        insert_rows([record(namespace_id, "later")])
    assert committed_keys(namespace_id) == ["later", "taken"]

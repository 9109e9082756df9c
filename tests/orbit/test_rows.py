"""orbit.rows reads, updates and inserts rows exactly as the ORM would."""

from __future__ import annotations

import datetime

import pytest
from django.db import IntegrityError, connection, transaction

from orbit.models import Event, IdempotencyRecord
from orbit.rows import Add, insert_rows, lock_by_pk, read_by_pk, select_rows, update_by_pk, writes_sent_together
from tasks.models import Task
from tests.tasks.support import make_queue, submit_ok


def field_values(row: object) -> dict[str, object]:
    return {field.attname: getattr(row, field.attname) for field in type(row)._meta.concrete_fields}


@pytest.mark.django_db
def test_rows_read_as_the_orm_reads_them(tenant):
    # given a task with a JSON payload, a key, times and a boolean
    queue = make_queue(tenant.client, "rows")
    submitted = submit_ok(
        tenant.client, queue["id"], "rows-1", payload={"a": [1, "é"]}, concurrency_key="object/A", priority=7
    )

    # when it is read through the plain-SQL helpers
    by_orm = Task.objects.get(id=submitted["id"])
    read = read_by_pk(Task, [submitted["id"], "0" * 32])
    locked = lock_by_pk(Task, [submitted["id"]])
    selected = select_rows(Task, "queue_id = %s ORDER BY id", [queue["id"]])

    # then every field has the ORM's value and type, and the rows are saved instances
    assert list(read) == [submitted["id"]]
    for row in (read[submitted["id"]], locked[submitted["id"]], selected[0]):
        assert field_values(row) == field_values(by_orm)
        assert row.available_at.tzinfo is not None
        assert row.payload == {"a": [1, "é"]}
        assert row.key_ready is by_orm.key_ready
        assert row._state.adding is False and row._state.db == connection.alias


@pytest.mark.django_db
def test_updates_and_inserts_store_what_the_orm_stores(tenant):
    queue = make_queue(tenant.client, "rows")
    task_id = submit_ok(tenant.client, queue["id"], "rows-2")["id"]
    moment = datetime.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=datetime.UTC)

    update_by_pk(Task, [task_id], {"epoch": Add(2), "updated_at": moment, "output": {"ok": True}, "last_error": None})
    insert_rows([Event(namespace_id="n" * 32, type="rows.test", subject_id=task_id, data={"x": 1})])

    task = Task.objects.get(id=task_id)
    assert (task.epoch, task.updated_at, task.output, task.last_error) == (2, moment, {"ok": True}, None)
    event = Event.objects.get(type="rows.test")
    assert (event.subject_id, event.data) == (task_id, {"x": 1})
    assert event.created_at is not None


@pytest.mark.django_db
def test_rows_held_in_a_transaction_carry_its_own_updates_and_are_written_once(tenant, django_assert_num_queries):
    from django.db import transaction

    from orbit.models import ApplicationState
    from orbit.rows import holding

    application_id = tenant.namespace.application_id
    with transaction.atomic():
        with holding(ApplicationState):
            before = lock_by_pk(ApplicationState, [application_id])[application_id]
            with django_assert_num_queries(0):  # held: changed and locked again without a statement
                update_by_pk(ApplicationState, [application_id], {"unfinished_tasks": Add(3)})
                changes = {"unfinished_tasks": Add(-1), "active_attempts": Add(2)}
                update_by_pk(ApplicationState, [application_id], changes)
                again = lock_by_pk(ApplicationState, [application_id])[application_id]
            assert again is before
            assert (again.unfinished_tasks, again.active_attempts) == (2, 2)
            with django_assert_num_queries(1):  # other models are not held
                lock_by_pk(Task, ["0" * 32])
            stored = ApplicationState.objects.get(application_id=application_id)
            assert (stored.unfinished_tasks, stored.active_attempts) == (0, 0)  # not written yet
        stored = ApplicationState.objects.get(application_id=application_id)
        assert (stored.unfinished_tasks, stored.active_attempts) == (2, 2)  # written once, at the block's end
    with django_assert_num_queries(1):  # outside the block every lock is a statement
        lock_by_pk(ApplicationState, [application_id])


@pytest.mark.django_db
def test_held_rows_are_not_written_when_the_block_raises(tenant):
    from orbit.models import ApplicationState
    from orbit.rows import holding

    application_id = tenant.namespace.application_id
    with pytest.raises(RuntimeError), holding(ApplicationState):
        lock_by_pk(ApplicationState, [application_id])
        update_by_pk(ApplicationState, [application_id], {"unfinished_tasks": Add(5)})
        raise RuntimeError("refused")
    assert ApplicationState.objects.get(application_id=application_id).unfinished_tasks == 0


def record(namespace_id: str, key: str) -> IdempotencyRecord:
    return IdempotencyRecord(
        namespace_id=namespace_id, key=key, operation="task.submit", digest="d", response_status=201, response_data={}
    )


@pytest.mark.mysql_only
@pytest.mark.django_db
def test_waiting_writes_go_with_the_next_statement_in_the_order_issued(tenant, django_assert_num_queries):
    queue = make_queue(tenant.client, "rows")
    task_id = submit_ok(tenant.client, queue["id"], "rows-3")["id"]
    with transaction.atomic(), writes_sent_together():
        with django_assert_num_queries(0):  # nothing sent yet
            update_by_pk(Task, [task_id], {"epoch": Add(1)})
            update_by_pk(Task, [task_id], {"epoch": Add(10)})
            insert_rows([Event(namespace_id="n" * 32, type="rows.waiting", subject_id=task_id, data={})])
        with django_assert_num_queries(1):  # the writes, then the ORM's read, in one query
            assert Task.objects.get(id=task_id).epoch == 11
        assert Event.objects.filter(type="rows.waiting").count() == 1
    with transaction.atomic(), django_assert_num_queries(1), writes_sent_together():
        update_by_pk(Task, [task_id], {"epoch": Add(100)})  # goes when the block ends
    assert Task.objects.get(id=task_id).epoch == 111


@pytest.mark.mysql_only
@pytest.mark.django_db
@pytest.mark.parametrize("position", ["first", "later"])
def test_a_waiting_write_that_fails_raises_as_django_does_and_the_connection_goes_on(tenant, position):
    namespace_id = tenant.namespace.id
    insert_rows([record(namespace_id, "taken")])
    with pytest.raises(IntegrityError), transaction.atomic(), writes_sent_together():
        if position == "later":
            insert_rows([record(namespace_id, "free")])
        insert_rows([record(namespace_id, "taken")])  # a twin on the unique index
        Task.objects.filter(id="0" * 32).exists()
    # the failed query left no result unread: the connection answers the next one
    keys = set(IdempotencyRecord.objects.filter(namespace_id=namespace_id).values_list("key", flat=True))
    assert keys == {"taken"}


@pytest.mark.mysql_only
@pytest.mark.django_db
def test_writes_still_waiting_when_the_block_raises_are_never_sent(tenant, django_assert_num_queries):
    namespace_id = tenant.namespace.id
    with pytest.raises(RuntimeError), django_assert_num_queries(0), writes_sent_together():
        insert_rows([record(namespace_id, "dropped")])
        raise RuntimeError("refused")
    assert not IdempotencyRecord.objects.filter(namespace_id=namespace_id).exists()

"""orbit.db.rows reads, updates and inserts rows exactly as the ORM would."""

from __future__ import annotations

import datetime
import itertools

import pytest
from django.db import IntegrityError, connection, models, transaction
from django.test.utils import CaptureQueriesContext

from orbit.db.rows import (
    Add,
    insert_rows,
    lock_by_pk,
    new_row,
    read_by_pk,
    select_rows,
    update_by_pk,
    update_each_by_pk,
    writes_sent_together,
)
from orbit.fields import new_id
from orbit.models import Event, IdempotencyRecord
from orbit.principal import Actor, authenticate_token
from tasks.actions.batch import Submission
from tasks.actions.rounds import LeaseRequest, SubmitRequest, run_round
from tasks.models import Attempt, Task
from tests.support.api import make_queue
from tests.support.tasks import submit_ok, task_body, worker_for

SEQ = itertools.count(1)  # orbit_event cursors are unique per namespace


def field_values(row: object, *, generated: bool = True) -> dict[str, object]:
    """Every field's value; `generated=False`: the stored ones only (a generated
    one is the database's to compute: a new row, like Model.__init__'s, has none)."""
    fields = type(row)._meta.concrete_fields
    return {field.attname: getattr(row, field.attname) for field in fields if generated or not field.generated}


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
    insert_rows([Event(namespace_id="n" * 32, seq=next(SEQ), type="rows.test", subject_id=task_id, data={"x": 1})])

    task = Task.objects.get(id=task_id)
    assert (task.epoch, task.updated_at, task.output, task.last_error) == (2, moment, {"ok": True}, None)
    event = Event.objects.get(type="rows.test")
    assert (event.subject_id, event.data) == (task_id, {"x": 1})
    assert event.created_at is not None


@pytest.mark.django_db
def test_each_row_gets_its_own_values_in_one_update(tenant, django_assert_num_queries):
    # given three tasks
    queue = make_queue(tenant.client, "rows")
    ids = [submit_ok(tenant.client, queue["id"], f"rows-each-{n}")["id"] for n in range(3)]
    moments = [datetime.datetime(2026, 1, 2, 3, 4, n, 5, tzinfo=datetime.UTC) for n in range(3)]

    # when two of them are given different values in one statement
    changes = {ids[n]: {"epoch": 10 + n, "updated_at": moments[n], "output": {"n": n}} for n in (0, 2)}
    with django_assert_num_queries(1):
        update_each_by_pk(Task, changes)

    # then each has its own, stored as the ORM stores it, and the third is untouched
    rows = Task.objects.in_bulk(ids)
    for n in (0, 2):
        assert (rows[ids[n]].epoch, rows[ids[n]].updated_at, rows[ids[n]].output) == (10 + n, moments[n], {"n": n})
    assert (rows[ids[1]].epoch, rows[ids[1]].output) == (0, None)


@pytest.mark.django_db
def test_a_value_every_row_shares_is_set_once_and_the_others_per_row(tenant):
    # given three tasks
    queue = make_queue(tenant.client, "rows")
    ids = [submit_ok(tenant.client, queue["id"], f"rows-shared-{n}")["id"] for n in range(3)]
    moment = datetime.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=datetime.UTC)

    # when each gets its own epoch and all of them the same time and output
    changes = {
        task_id: {"epoch": 20 + n, "updated_at": moment, "output": {"same": True}} for n, task_id in enumerate(ids)
    }
    with CaptureQueriesContext(connection) as captured:
        update_each_by_pk(Task, changes)

    # then one statement sets the shared values plainly and the epochs by row
    (statement,) = [query["sql"] for query in captured.captured_queries if query["sql"].startswith("UPDATE")]
    assert statement.count("CASE") == 1, statement
    rows = Task.objects.in_bulk(ids)
    for n, task_id in enumerate(ids):
        assert (rows[task_id].epoch, rows[task_id].updated_at, rows[task_id].output) == (20 + n, moment, {"same": True})


@pytest.mark.django_db
def test_values_equal_but_of_other_types_are_not_taken_as_shared(tenant):
    # 1 == True in Python; a JSON output of 1 and one of true are not the same value
    queue = make_queue(tenant.client, "rows")
    ids = [submit_ok(tenant.client, queue["id"], f"rows-typed-{n}")["id"] for n in range(2)]
    update_each_by_pk(Task, {ids[0]: {"output": 1}, ids[1]: {"output": True}})
    rows = Task.objects.in_bulk(ids)
    assert rows[ids[0]].output == 1 and type(rows[ids[0]].output) is int
    assert rows[ids[1]].output is True


@pytest.mark.django_db
def test_each_inserted_value_is_the_one_its_field_would_save(monkeypatch):
    import copy

    from django.utils import timezone
    from django.utils.functional import lazy

    moment = datetime.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=datetime.UTC)
    monkeypatch.setattr(timezone, "now", lambda: moment)  # Event.created_at is auto_now_add
    east = datetime.timezone(datetime.timedelta(hours=8))
    common = {"namespace_id": "n" * 32, "application_id": "a" * 32, "queue_id": "q" * 32, "handler": "h"}
    common |= {"handler_version": "v1", "payload_version": "v1", "state": "WAITING"}
    tasks = [
        new_row(
            Task, id=new_id(), **common, payload={"k": 1}, available_at=moment, created_at=moment, updated_at=moment
        ),
        new_row(
            Task,
            id=new_id(),
            **common,
            payload=None,
            business_key=lazy(lambda: "lazy", str)(),  # resolved by the field, not sent as is
            priority="7",  # a number the field converts
            key_ready=1,
            retry_multiplier=3,  # an int in a FloatField
            available_at=moment.astimezone(east),
            deadline_at=moment,
            created_at=moment,
            updated_at=moment,
            output={"ok": [1, 2]},
        ),
    ]
    events = [Event(namespace_id="n" * 32, seq=next(SEQ), type="rows.values", subject_id="s" * 32, data={"x": None})]
    sent: list[list[object]] = []
    monkeypatch.setattr("orbit.db.rows._write", lambda db, sql, params, size=None: sent.append(params))
    for rows in (tasks, events):
        expected = [
            field.get_db_prep_save(field.pre_save(row, True), connection)
            for row in copy.deepcopy(rows)
            for field in type(row)._meta.concrete_fields
            if not isinstance(field, models.AutoField) and not field.generated  # as the ORM's insert
        ]
        sent.clear()
        insert_rows(rows)
        assert sent == [expected]
        assert [type(value) for value in sent[0]] == [type(value) for value in expected]


@pytest.mark.django_db
def test_rows_held_in_a_transaction_carry_its_own_updates_and_are_written_once(tenant, django_assert_num_queries):
    from django.db import transaction

    from orbit.db.rows import holding
    from orbit.models import ApplicationState

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


@pytest.mark.mysql_only
@pytest.mark.django_db
def test_rows_of_several_held_models_are_locked_in_one_round_trip(tenant, django_assert_num_queries):
    from orbit.db.rows import holding, lock_by_pk_together
    from orbit.models import ApplicationState
    from queues.models import QueueState

    application_id = tenant.namespace.application_id
    queue_id = make_queue(tenant.client, "together")["id"]
    with transaction.atomic(), holding(ApplicationState, QueueState):
        with django_assert_num_queries(1) as captured:
            lock_by_pk_together([(ApplicationState, [application_id]), (QueueState, [queue_id, "0" * 32])])
        sql = captured.captured_queries[0]["sql"]
        assert sql.index("`orbit_application_state`") < sql.index("`orbit_queue_state`")  # in the order given
        assert sql.count("FOR UPDATE") == 2
        with django_assert_num_queries(0):  # kept: locked again without a statement
            assert list(lock_by_pk(ApplicationState, [application_id])) == [application_id]
            assert list(lock_by_pk(QueueState, [queue_id])) == [queue_id]
        with django_assert_num_queries(0):  # nothing left to lock: nothing sent
            lock_by_pk_together([(ApplicationState, [application_id]), (QueueState, [queue_id])])


@pytest.mark.mysql_only
@pytest.mark.django_db
def test_rows_locked_ahead_are_handed_once_to_the_lock_that_asks_for_them(tenant, django_assert_num_queries):
    from orbit.db.rows import lock_by_pk_together, locked_ahead
    from orbit.models import ApplicationState

    application_id = tenant.namespace.application_id
    queue = make_queue(tenant.client, "ahead")
    task_ids = [submit_ok(tenant.client, queue["id"], f"ahead-{n}")["id"] for n in range(2)]
    missing = "0" * 32
    with transaction.atomic(), locked_ahead():
        with django_assert_num_queries(1) as captured:
            ahead = [(Task, [*task_ids, missing])]
            (states,) = lock_by_pk_together([(ApplicationState, [application_id])], ahead=ahead)
        sql = captured.captured_queries[0]["sql"]
        assert sql.index("`orbit_application_state`") < sql.index("`orbit_task`")  # the counters first
        assert sql.count("FOR UPDATE") == 2
        assert list(states) == [application_id]
        with django_assert_num_queries(0):  # handed over, with the row that was not there
            assert sorted(lock_by_pk(Task, [task_ids[0], missing])) == [task_ids[0]]
        with django_assert_num_queries(1):  # once only: asked again, it is locked (read) again
            assert list(lock_by_pk(Task, [task_ids[0]])) == [task_ids[0]]
        with django_assert_num_queries(1):  # the second is still kept; only the first is sent for
            assert sorted(lock_by_pk(Task, task_ids)) == sorted(task_ids)
    with transaction.atomic(), pytest.raises(AssertionError, match="locked_ahead"):
        lock_by_pk_together([], ahead=[(Task, task_ids)])


@pytest.mark.django_db
def test_held_rows_are_not_written_when_the_block_raises(tenant):
    from orbit.db.rows import holding
    from orbit.models import ApplicationState

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
            insert_rows([Event(namespace_id="n" * 32, seq=next(SEQ), type="rows.waiting", subject_id=task_id, data={})])
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


@pytest.mark.parametrize("model", [Task, Attempt, Event, IdempotencyRecord])
def test_new_rows_are_built_as_model_init_builds_them(model):
    given = {"namespace_id": "n" * 32, "payload": {"a": 1}} if model is Task else {"namespace_id": "n" * 32}
    given = {name: value for name, value in given.items() if hasattr(model, name)}
    made, by_init = new_row(model, **given), model(**given)
    # defaults that are fresh per call (ids, times) differ; everything else is equal
    fresh = {f.attname for f in model._meta.concrete_fields if callable(f.default) and not f.generated}
    assert made.__dict__.keys() == by_init.__dict__.keys()
    assert {k: v for k, v in field_values(made, generated=False).items() if k not in fresh} == {
        k: v for k, v in field_values(by_init, generated=False).items() if k not in fresh
    }
    assert all(type(getattr(made, name)) is type(getattr(by_init, name)) for name in fresh)
    assert made._state.adding and made._state.db is None


@pytest.mark.parametrize("model", [Task, Attempt, Event, IdempotencyRecord])
def test_defaults_made_per_row_are_made_for_each_row(model):
    fresh = [field for field in model._meta.concrete_fields if field.has_default() and callable(field.default)]
    first, second = new_row(model), new_row(model)
    for field in fresh:
        made = getattr(first, field.attname), getattr(second, field.attname)
        assert made[0] is not None, field.name
        if isinstance(made[0], (dict, list)):
            assert made[0] is not made[1], field.name  # never one object shared by two rows
        elif field.primary_key:
            assert made[0] != made[1]


def test_a_value_given_by_another_name_goes_through_model_init():
    with pytest.raises(TypeError):
        new_row(Task, not_a_field=1)  # Model.__init__'s own refusal
    payload = {"kept": True}
    assert new_row(Task, payload=payload).payload is payload


@pytest.mark.django_db
def test_a_round_builds_its_new_rows_without_model_init(tenant, monkeypatch):
    queue = make_queue(tenant.client, "fresh-rows", max_concurrency=50, rate_per_second=1000)
    actor = Actor(principal=authenticate_token(tenant.token), request_id=new_id())
    worker = worker_for(tenant, queue["id"])

    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("Model.__init__ called for a new row")

    for model in (Task, Attempt, Event, IdempotencyRecord):
        monkeypatch.setattr(model, "__init__", refuse)
    submit = SubmitRequest(actor, Submission(key="fresh", body=task_body(queue["id"]), request_id=new_id()))
    submitted, leased = run_round([submit, LeaseRequest(worker, 1)])

    assert submitted.status == 201 and len(leased.assignments) == 1
    assert Event.objects.filter(subject_id=submitted.data["task"]["id"]).exists()


@pytest.mark.mysql_only
@pytest.mark.django_db
def test_datetimes_are_made_aware_without_make_aware_on_mysql(tenant):
    from orbit.db.rows import _shape

    queue = make_queue(tenant.client, "aware")
    task_id = submit_ok(tenant.client, queue["id"], "aware-1")["id"]
    shape = _shape(Task, connection)
    converters = {shape.attnames[index]: found for index, _, found in shape.converters}
    assert [convert.__qualname__ for convert in converters["available_at"]] == ["_made_aware.<locals>.convert"]
    read = read_by_pk(Task, [task_id])[task_id]
    assert read.available_at == Task.objects.get(id=task_id).available_at
    assert read.available_at.tzinfo is connection.timezone
    assert read.start_deadline_at is None

"""The MySQL backend sends autocommit changes with the next statement
(orbit/db/mysql/base.py); the server must see exactly the
transactions Django asked for."""

from __future__ import annotations

import datetime
import decimal
import enum
import itertools
import zoneinfo
from collections.abc import Iterator

import MySQLdb
import pytest
from django.db import IntegrityError, connection, transaction
from django.db.backends.mysql.operations import DatabaseOperations as DjangoOperations
from django.utils import timezone
from django.utils.safestring import SafeString
from MySQLdb.times import DateTime_or_None

from orbit.db.mysql.base import datetime_or_none
from orbit.db.rows import atomic_sent_together, insert_rows, new_row
from orbit.models import Event
from tests.support.other_connection import other_cursor

SEQ = itertools.count(1)  # orbit_event cursors are unique per namespace

pytestmark = [pytest.mark.mysql_only, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def sent() -> Iterator[list[str]]:
    """Every query and autocommit call the driver sends on this thread's connection."""
    connection.ensure_connection()
    raw = connection.connection
    calls: list[str] = []
    query, autocommit = raw.query, raw.autocommit
    raw.query = lambda sql: (calls.append(sql.decode() if isinstance(sql, bytes) else sql), query(sql))[1]
    raw.autocommit = lambda on: (calls.append(f"autocommit({on})"), autocommit(on))[1]
    try:
        yield calls
    finally:
        connection.close()  # the patched connection is not reused


def other_connection_sees(subject_id: str) -> bool:
    with other_cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM orbit_event WHERE subject_id = %s", [subject_id])
        return cursor.fetchone()[0] == 1


def event(subject_id: str) -> None:
    Event.objects.create(namespace_id="n" * 32, seq=next(SEQ), type="backend.test", subject_id=subject_id, data={})


def test_a_transaction_begins_with_its_first_statement_and_autocommit_returns_with_the_next(sent):
    Event.objects.exists()  # outside a transaction: the server is in autocommit now
    assert connection.connection.get_autocommit() is True
    sent.clear()
    with transaction.atomic():
        assert sent == []  # nothing is sent to begin
        event("inside")
        assert sent[0].startswith("SET autocommit=0; INSERT INTO `orbit_event`")
        assert connection.connection.get_autocommit() is False
        assert not other_connection_sees("inside")  # uncommitted
    assert other_connection_sees("inside")
    sent.clear()
    event("after")
    assert sent[0].startswith("SET autocommit=1; INSERT INTO `orbit_event`")
    assert other_connection_sees("after")  # committed by itself
    event("again")
    assert sent[1].startswith("INSERT INTO `orbit_event`")  # the server has it already


def test_a_transaction_that_runs_no_statement_sends_nothing_but_its_commit(sent):
    Event.objects.exists()
    sent.clear()
    with transaction.atomic():
        pass
    assert not any(call.startswith(("SET autocommit", "autocommit(")) for call in sent)


def test_a_failing_statement_after_the_change_raises_as_django_does(sent):
    Event.objects.exists()  # outside a transaction: the server is in autocommit now
    sent.clear()
    with pytest.raises(IntegrityError), transaction.atomic():
        # NOT NULL refused: MySQL error 1048, which Django reports as an IntegrityError
        Event.objects.create(namespace_id="n" * 32, seq=next(SEQ), type=None, subject_id="x", data={})  # type: ignore[misc]
    assert sent[0].startswith("SET autocommit=0; INSERT")
    event("after-failure")  # the connection goes on, back in autocommit
    assert other_connection_sees("after-failure")


@pytest.mark.parametrize(
    "text",
    [
        "2026-11-30 12:00:01.123456",
        "2026-11-30 12:00:01.000000",
        "2026-11-30 12:00:01",
        "0001-01-01 00:00:00",
        "9999-12-31 23:59:59.999999",
        "0000-00-00 00:00:00",  # a zero date: None
        "2026-02-30 00:00:00",  # no such day: None
        "2026-11-30",
        "2026-11-30 12:00:01.5",
        "2026-11-30T12:00:01",
    ],
)
def test_datetimes_are_read_as_the_driver_reads_them(text):
    assert datetime_or_none(text) == DateTime_or_None(text)


def test_the_connection_reads_datetime_columns_with_the_fast_parser():
    with connection.cursor() as cursor:
        cursor.execute("SELECT CAST('2026-11-30 12:00:01.123456' AS DATETIME(6)), CAST('2026-11-30' AS DATETIME)")
        exact, midnight = cursor.fetchone()
    assert (exact.isoformat(), midnight.isoformat()) == ("2026-11-30T12:00:01.123456", "2026-11-30T00:00:00")
    assert connection.connection.converter[MySQLdb.constants.FIELD_TYPE.DATETIME].__name__ == "datetime_or_none"


class Small(enum.IntEnum):
    ONE = 1


BOUND_VALUES = [
    "plain",
    "",
    "quote ' backslash \\ nul \x00 newline \n",
    "ü€😀",
    SafeString("a subclass of str"),
    0,
    -5,
    2**70,
    None,
    True,
    False,
    1.5,
    b"bytes ' too",
    decimal.Decimal("1.20"),
    Small.ONE,
    [1, "a", None],
    ("x",),
    datetime.date(2026, 12, 6),
]


@pytest.mark.parametrize("value", BOUND_VALUES, ids=repr)
def test_bound_values_are_escaped_as_the_driver_escapes_them(value):
    connection.ensure_connection()
    driver = connection.connection
    assert driver.quick_literals
    assert driver.literal(value) == MySQLdb.connections.Connection.literal(driver, value)


WRITTEN_DATETIMES = [
    datetime.datetime(2026, 12, 6, 5, 0, 19, 636709, tzinfo=datetime.UTC),
    datetime.datetime(2026, 12, 6, 5, 0, 19, tzinfo=datetime.UTC),  # no microseconds: none written
    datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),  # another zone
    datetime.datetime(2026, 1, 1, 5, 6, 7, 8, tzinfo=zoneinfo.ZoneInfo("UTC")),  # UTC, another object
    None,
]


@pytest.mark.parametrize("value", WRITTEN_DATETIMES, ids=repr)
def test_datetimes_are_written_as_django_writes_them(value):
    ours = connection.ops.adapt_datetimefield_value(value)
    djangos = DjangoOperations(connection).adapt_datetimefield_value(value)
    assert (ours, type(ours)) == (djangos, type(djangos))


def test_the_zone_of_timezone_now_is_the_connections_own():
    # the quick path above is the one every timezone.now() takes
    assert timezone.now().tzinfo is connection.timezone


def test_the_last_writes_of_an_outermost_transaction_carry_its_commit(sent):
    Event.objects.exists()
    commits: list[str] = []
    raw = connection.connection
    commit = raw.commit
    raw.commit = lambda: (commits.append("commit()"), commit())[1]  # the fixture closes this connection
    sent.clear()
    with atomic_sent_together():
        insert_rows(
            [new_row(Event, namespace_id="n" * 32, seq=next(SEQ), type="backend.test", subject_id="rides", data={})]
        )
        assert sent == []  # waiting
        assert not other_connection_sees("rides")
    assert len(sent) == 1 and sent[0].startswith("SET autocommit=0; INSERT INTO `orbit_event`")
    assert sent[0].endswith("; COMMIT") and commits == []  # one round trip, no commit of its own
    assert other_connection_sees("rides")
    assert connection.commit_sent is False  # used up
    with transaction.atomic():  # the next transaction commits as usual
        event("next")
    assert commits == ["commit()"] and other_connection_sees("next")


def test_a_failing_last_write_stops_before_the_commit_and_rolls_back(sent):
    Event.objects.exists()
    with pytest.raises(IntegrityError), atomic_sent_together():
        insert_rows(
            [new_row(Event, namespace_id="n" * 32, seq=next(SEQ), type="backend.test", subject_id="undone", data={})]
        )
        insert_rows([new_row(Event, namespace_id="n" * 32, seq=next(SEQ), type=None, subject_id="refused", data={})])
    assert sent[-1].endswith("; COMMIT")  # sent, never reached
    assert not other_connection_sees("undone")
    assert connection.commit_sent is False
    event("after-failure")
    assert other_connection_sees("after-failure")


def test_inside_an_outer_transaction_the_writes_go_without_a_commit(sent):
    Event.objects.exists()
    with pytest.raises(RuntimeError), transaction.atomic():
        with atomic_sent_together():
            insert_rows(
                [new_row(Event, namespace_id="n" * 32, seq=next(SEQ), type="backend.test", subject_id="inner", data={})]
            )
        assert not sent[-1].endswith("COMMIT")
        raise RuntimeError("the outer transaction rolls back")
    assert not other_connection_sees("inner")

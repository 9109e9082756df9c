"""The event log's cursors follow the commit order with no gaps: a reader that
polls after its cursor sees every event once, in order, whatever commits
around it (orbit.audit._insert_events)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db import connection, transaction

from orbit.audit import emit_event, event_page, gathered_events
from orbit.models import Event, EventSequence
from orbit.principal import authenticate_token
from tests.support.factories import NamespaceFactory, make_credential
from tests.support.race import race

pytestmark = pytest.mark.django_db(transaction=True)


@contextmanager
def atomic_with_events() -> Iterator[None]:
    """A transaction whose events are written at its end, as orbit.transactions.outermost
    opens one, but nestable: the tests hold some open past their events."""
    with transaction.atomic(), gathered_events():
        yield


def emit(namespace_id: str, label: str, count: int = 1) -> None:
    with atomic_with_events():
        for n in range(count):
            data = {"label": f"{label}.{n}"}
            emit_event(namespace_id=namespace_id, type="test.event", subject_id="s" * 32, data=data)


def test_cursors_count_from_one_per_namespace_in_emit_order():
    first, second = NamespaceFactory(), NamespaceFactory()
    emit(first.id, "a", 3)
    emit(second.id, "b", 2)
    emit(first.id, "c", 1)
    rows = list(Event.objects.filter(namespace_id=first.id).order_by("seq").values_list("seq", "data"))
    assert rows == [(1, {"label": "a.0"}), (2, {"label": "a.1"}), (3, {"label": "a.2"}), (4, {"label": "c.0"})]
    assert list(Event.objects.filter(namespace_id=second.id).order_by("seq").values_list("seq", flat=True)) == [1, 2]
    assert EventSequence.objects.get(pk=first.id).last_seq == 4


def test_a_rolled_back_transaction_leaves_no_gap():
    namespace = NamespaceFactory()
    emit(namespace.id, "kept")
    with pytest.raises(RuntimeError), atomic_with_events():
        emit_event(namespace_id=namespace.id, type="test.event", subject_id="s" * 32, data={})
        raise RuntimeError("rolled back")
    emit(namespace.id, "next")
    assert list(Event.objects.filter(namespace_id=namespace.id).order_by("seq").values_list("seq", flat=True)) == [1, 2]


def test_an_open_transaction_holds_back_every_later_event():
    """The writer that took cursor N first makes the others wait: nothing after
    N is visible before N is, so a reader cannot pass it by."""
    namespace = NamespaceFactory()
    principal = authenticate_token(make_credential(namespace, scopes=["tasks:read", "queues:read"]).token)
    emit(namespace.id, "before")
    holding = threading.Event()
    release = threading.Event()
    later_done = threading.Event()

    def slow_open() -> None:
        try:
            with transaction.atomic():  # open past its events: an outer block commits them
                with atomic_with_events():
                    emit_event(
                        namespace_id=namespace.id, type="test.event", subject_id="s" * 32, data={"label": "slow"}
                    )
                holding.set()
                release.wait(timeout=30)
        finally:
            connection.close()

    def later() -> None:
        try:
            emit(namespace.id, "later")
            later_done.set()
        finally:
            connection.close()

    first = threading.Thread(target=slow_open)
    first.start()
    assert holding.wait(timeout=30)
    second = threading.Thread(target=later)
    second.start()
    time.sleep(0.5)
    try:
        assert not later_done.is_set(), "a later event committed while an earlier cursor was still open"
        assert [item["data"]["label"] for item in event_page(principal=principal, after=0, limit=10)] == ["before.0"]
    finally:
        release.set()
        first.join(timeout=30)
        second.join(timeout=30)
    assert later_done.is_set()
    page = event_page(principal=principal, after=1, limit=10)
    assert [(item["cursor"], item["data"]["label"]) for item in page] == [("2", "slow"), ("3", "later.0")]


def test_a_polling_reader_sees_every_event_once_in_order_while_writers_race():
    namespace = NamespaceFactory()
    principal = authenticate_token(make_credential(namespace, scopes=["tasks:read", "queues:read"]).token)
    writers, rounds, per_round = 8, 15, 3
    total = writers * rounds * per_round
    seen: list[tuple[int, str]] = []
    stop = threading.Event()
    reader_errors: list[BaseException] = []

    def read() -> None:
        cursor = 0
        try:
            while len(seen) < total and not stop.is_set():
                page = event_page(principal=principal, after=cursor, limit=7)
                for item in page:
                    seen.append((int(item["cursor"]), item["data"]["label"]))
                    cursor = int(item["cursor"])
                if not page:
                    time.sleep(0.002)
        except BaseException as exc:  # noqa: BLE001 - reported below
            reader_errors.append(exc)
        finally:
            connection.close()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        race(writers, lambda index: [emit(namespace.id, f"w{index}.r{r}", per_round) for r in range(rounds)])
    finally:
        deadline = time.monotonic() + 30
        while len(seen) < total and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        reader.join(timeout=30)
    assert not reader_errors, reader_errors
    # every event once, cursors 1..N with no gap, each writer's events in its own order
    assert [cursor for cursor, _ in seen] == list(range(1, total + 1))
    labels = [label for _, label in seen]
    assert len(set(labels)) == total
    for index in range(writers):
        mine = [label for label in labels if label.startswith(f"w{index}.")]
        assert mine == [f"w{index}.r{r}.{n}" for r in range(rounds) for n in range(per_round)]

"""The guard's optional slot (SPEC §12): a key of capacity N has N valid holders at once, one per
slot, so a write is refused only when a newer token of the same (key, slot) was accepted. Without
a slot, exactly the key-wide fence of a key of capacity 1. On MariaDB, PostgreSQL and SQLite."""

from __future__ import annotations

import dataclasses
import datetime
import random
import threading
from typing import Any

import pytest

from orbit_sdk import fencing
from orbit_sdk.fencing._ddl import _key_ddl
from tests.fencing.dbs import DB
from tests.fencing.procs import ledger_insert

NS = "0123456789abcdef0123456789abcdef"


def rows(db: DB, sql: str) -> list[tuple[Any, ...]]:
    conn = db.connect()
    try:
        cursor = conn.cursor()
        cursor.execute(sql)
        found = [tuple(row) for row in cursor.fetchall()]
        cursor.close()
        return found
    finally:
        conn.close()


def insert(db: DB, key: str, token: int, op: str, writer: int = 0) -> Any:
    return lambda conn: ledger_insert(db, conn, key, token, op, writer)


def test_holders_of_different_slots_both_write_and_a_slot_fences_its_own_older_tokens(fence_db: DB) -> None:
    db = fence_db
    guard = fencing.Guard(db.connect())
    guard.write(NS, "k", 5, "slot0-t5", insert(db, "k", 5, "slot0-t5"), slot=0)
    # an older token of another slot is a valid holder of that slot: it writes
    guard.write(NS, "k", 3, "slot1-t3", insert(db, "k", 3, "slot1-t3"), slot=1)
    assert guard.highest(NS, "k", 0) == 5 and guard.highest(NS, "k", 1) == 3
    # a newer holder of slot 1 ends the older one's writes there, not slot 0's holder's
    guard.write(NS, "k", 8, "slot1-t8", insert(db, "k", 8, "slot1-t8"), slot=1)
    with pytest.raises(fencing.StaleToken) as caught:
        guard.write(NS, "k", 3, "slot1-t3-again", insert(db, "k", 3, "slot1-t3-again"), slot=1)
    assert (caught.value.token, caught.value.highest, caught.value.slot) == (3, 8, 1)
    assert "slot 1" in str(caught.value)
    guard.write(NS, "k", 5, "slot0-t5-b", insert(db, "k", 5, "slot0-t5-b"), slot=0)
    assert [row[0] for row in rows(db, "SELECT operation_id FROM ledger ORDER BY id")] == [
        "slot0-t5",
        "slot1-t3",
        "slot1-t8",
        "slot0-t5-b",
    ]
    # the key-wide fence is untouched by slot writes, and slot writes by it
    assert guard.highest(NS, "k") == 0
    assert rows(db, f"SELECT COUNT(*) FROM {fencing.FENCE_TABLE}") == [(0,)]


def test_without_a_slot_the_fence_is_the_keys_exactly_as_before(fence_db: DB) -> None:
    db = fence_db
    guard = fencing.Guard(db.connect())
    guard.write(NS, "k", 5, "a", insert(db, "k", 5, "a"))
    with pytest.raises(fencing.StaleToken) as caught:
        guard.write(NS, "k", 3, "b", insert(db, "k", 3, "b"))
    assert caught.value.slot is None and "slot" not in str(caught.value)
    assert rows(db, f"SELECT COUNT(*) FROM {fencing.FENCE_SLOT_TABLE}") == [(0,)]


def test_an_operation_is_applied_once_per_key_whichever_slot_sends_it(fence_db: DB) -> None:
    db = fence_db
    guard = fencing.Guard(db.connect())
    first = guard.apply(NS, "k", 4, "op", lambda conn: {"by": "slot 0"}, slot=0)
    again = guard.apply(NS, "k", 6, "op", lambda conn: {"by": "slot 1"}, slot=1)
    assert not first.replayed and again.replayed and again.result == {"by": "slot 0"}


def test_concurrent_holders_per_slot_land_only_writes_not_older_than_their_slots_last(fence_db: DB) -> None:
    """Two writers per slot on three slots, at once: each slot's landed tokens never go down in
    landing order, each slot's newest token lands although other slots accepted newer tokens,
    and the fence rows end at each slot's newest."""
    db = fence_db
    slots = 3
    plan: dict[int, list[int]] = {slot: list(range(slot + 1, 61, slots)) for slot in range(slots)}
    barrier = threading.Barrier(2 * slots)
    errors: list[BaseException] = []

    def writer(slot: int, part: int) -> None:
        conn = db.connect()
        try:
            guard = fencing.Guard(conn)
            rng = random.Random(slot * 10 + part)
            mine = plan[slot][part::2]
            barrier.wait()
            for token in mine:
                if rng.random() < 0.3:
                    token = max(1, token - slots * 2)  # a late, older write of the same slot
                op = f"s{slot}-t{token}-w{part}-{rng.random()}"
                try:
                    guard.write(NS, "k", token, op, insert(db, "k", token, op, slot), slot=slot)
                except fencing.StaleToken as exc:
                    assert exc.slot == slot and exc.token < exc.highest
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=writer, args=(slot, part)) for slot in range(slots) for part in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    landed = rows(db, "SELECT writer, token FROM ledger ORDER BY id")
    for slot in range(slots):
        tokens = [int(token) for writer, token in landed if int(writer) == slot]
        assert tokens == sorted(tokens), (slot, tokens)
        assert tokens[-1] == max(plan[slot])
        assert fencing.Guard(db.connect()).highest(NS, "k", slot) == max(plan[slot])


@dataclasses.dataclass
class FakeExecution:
    namespace_id: str | None
    concurrency_token: int | None
    lease_expires_at: datetime.datetime | None
    key: str | None = "k"
    concurrency_slot: int | None = None

    @property
    def concurrency_key(self) -> str | None:
        return self.key


@dataclasses.dataclass
class SeedExecution:
    """An execution as an SDK before capacities made it: no concurrency_slot at all."""

    namespace_id: str | None
    concurrency_token: int | None
    lease_expires_at: datetime.datetime | None

    @property
    def concurrency_key(self) -> str | None:
        return "k"


def test_for_execution_fences_the_executions_slot(fence_db: DB) -> None:
    db = fence_db
    guard = fencing.Guard(db.connect())
    slot0 = FakeExecution(NS, 9, None, concurrency_slot=0)
    slot1 = FakeExecution(NS, 7, None, concurrency_slot=1)
    assert guard.for_execution(slot0, check_lease=False).write("a", lambda conn: 1) == 1
    assert guard.for_execution(slot1, check_lease=False).write("b", lambda conn: 2) == 2
    assert guard.highest(NS, "k", 0) == 9 and guard.highest(NS, "k", 1) == 7
    # capacity 1 (no slot), and an execution object without the attribute: the key's fence
    for execution in (FakeExecution(NS, 4, None), SeedExecution(NS, 5, None)):
        guard.for_execution(execution, check_lease=False).write(f"c{execution.concurrency_token}", lambda conn: 3)
    assert guard.highest(NS, "k") == 5


def test_a_guard_installed_before_slots_gains_the_slot_table_and_keeps_its_rows(fence_db: DB) -> None:
    db = fence_db
    conn = db.connect()
    cursor = conn.cursor()
    for statement in fencing.slot_drop_ddl(db.dialect):
        cursor.execute(statement)
    cursor.close()
    conn.commit()
    guard = fencing.Guard(conn)
    guard.write(NS, "k", 6, "before", lambda conn: "old")  # the two tables of before work alone
    with pytest.raises(Exception):  # noqa: B017 - the driver's own "no such table"
        guard.write(NS, "k", 7, "slotted", lambda conn: "new", slot=1)
    fencing.install(conn)  # again: creates what is missing, touches nothing else
    assert guard.highest(NS, "k") == 6
    assert guard.write(NS, "k", 7, "slotted", lambda conn: "new", slot=1) == "new"
    assert guard.highest(NS, "k", 1) == 7 and guard.highest(NS, "k") == 6


def test_ddl_has_the_slot_table_last_and_slot_ddl_alone_is_it() -> None:
    for dialect in fencing.DIALECTS:
        statements = fencing.ddl(dialect)
        assert statements[: len(_key_ddl(dialect))] == _key_ddl(dialect)
        assert statements[len(_key_ddl(dialect)) :] == fencing.slot_ddl(dialect)
        assert all(fencing.FENCE_SLOT_TABLE in statement for statement in fencing.slot_ddl(dialect))
        assert fencing.drop_ddl(dialect)[0] == fencing.slot_drop_ddl(dialect)[0]
    (operation,) = fencing.django_slot_operations("mysql")
    assert operation.sql == fencing.slot_ddl("mysql") and operation.reverse_sql == fencing.slot_drop_ddl("mysql")


@pytest.mark.parametrize("slot", [-1, True, 1.0, "1", 2**31])
def test_a_bad_slot_is_refused_before_any_statement(slot: Any) -> None:
    class NoConnection:
        def cursor(self) -> Any:
            raise AssertionError("no statement may run")

    guard = fencing.Guard(NoConnection(), "sqlite")
    with pytest.raises(ValueError, match="slot"):
        guard.write(NS, "k", 1, "op", lambda conn: None, slot=slot)


def test_the_slot_header_goes_out_and_comes_back() -> None:
    execution = FakeExecution(NS, 12, None, concurrency_slot=2)
    headers = fencing.headers_for(execution, "op-1")
    assert headers[fencing.HEADER_SLOT] == "2"
    request = fencing.parse_headers(headers.get)
    assert request is not None and request.slot == 2 and request.token == 12
    assert fencing.HEADER_SLOT not in fencing.headers_for(FakeExecution(NS, 12, None), "op-1")
    no_slot = fencing.parse_headers(fencing.headers_for(FakeExecution(NS, 12, None), "op-1").get)
    assert no_slot is not None and no_slot.slot is None
    for bad in ("-1", "01", "x", "2147483648", "１"):
        with pytest.raises(ValueError, match=fencing.HEADER_SLOT):
            fencing.parse_headers({**headers, fencing.HEADER_SLOT: bad}.get)
    with pytest.raises(ValueError, match="missing"):
        fencing.parse_headers({fencing.HEADER_SLOT: "1"}.get)

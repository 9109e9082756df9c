"""orbit_sdk.fencing.Guard on real MariaDB, PostgreSQL and SQLite (seed keyed-concurrency §4):
the one atomic check-raise-dedupe-write, across processes."""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from orbit_sdk import fencing
from tests.fencing.dbs import DB, ROOT
from tests.fencing.procs import ledger_insert

NS = "0123456789abcdef0123456789abcdef"  # a namespace id, as Orbit's credentials carry


def child(spec: dict[str, Any], tmp_path: Path, name: str) -> subprocess.Popen[bytes]:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    return subprocess.Popen([sys.executable, "-m", "tests.fencing.procs", str(path)], cwd=ROOT)


def ledger(db: DB) -> list[tuple[Any, ...]]:
    conn = db.connect()
    try:
        cursor = conn.cursor()
        cursor.execute("SELECT id, fence_key, token, operation_id, writer FROM ledger ORDER BY id")
        rows = [tuple(row) for row in cursor.fetchall()]
        cursor.close()
        return rows
    finally:
        conn.close()


def count(db: DB, table: str) -> int:
    conn = db.connect()
    try:
        cursor = conn.cursor()
        cursor.execute(f"SELECT COUNT(*) FROM {table}")
        (value,) = cursor.fetchone()
        cursor.close()
        return int(value)
    finally:
        conn.close()


def guard_on(db: DB) -> fencing.Guard:
    return fencing.Guard(db.connect())


def test_several_processes_land_only_non_stale_writes_each_operation_once(fence_db: DB, tmp_path: Path) -> None:
    db = fence_db
    keys = ["object/a", "object/A", "objet/é"]  # byte-exact: "a" and "A" are different fences
    # Every token of every key has two operations; each is sent by two different writers (the
    # second is a replay). Every writer sends its share in roughly ascending token order with
    # jitter (as successive holders would), so tokens arrive interleaved and sometimes late.
    plan = [(key, token, f"{key}#{token}-{part}") for key in keys for token in range(1, 7) for part in "xy"]
    writers = 4
    rng = random.Random(24)
    shares: list[list[tuple[str, int, str]]] = [[] for _ in range(writers)]
    for op in plan:
        for writer in rng.sample(range(writers), 2):
            shares[writer].append(op)
    for share in shares:
        share.sort(key=lambda op: op[1] + rng.uniform(-2.5, 2.5))
    start = tmp_path / "start"
    procs = [
        child(
            {
                "mode": "writes",
                "db": db.to_json(),
                # MySQL: both drivers at once on the same rows.
                "driver": "pymysql" if n % 2 else "mysqlclient",
                "writer": n,
                "namespace": NS,
                "ops": share,
                "out": str(tmp_path / f"out-{n}.json"),
                "start_file": str(start),
            },
            tmp_path,
            f"writer-{n}",
        )
        for n, share in enumerate(shares)
    ]
    time.sleep(0.5)  # let every interpreter start and connect
    start.write_text("go")
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    outcomes = [o for n in range(writers) for o in json.loads((tmp_path / f"out-{n}.json").read_text())]

    rows = ledger(db)
    # Only non-stale writes landed: per key, in the order writes committed, tokens never go down.
    by_key: dict[str, list[int]] = defaultdict(list)
    for _id, key, token, _op, _writer in rows:
        by_key[key].append(int(token))
    for key, tokens in by_key.items():
        assert tokens == sorted(tokens), (key, tokens)
    # Each operation at most once, and recorded exactly when it was written.
    written = [row[3] for row in rows]
    assert len(written) == len(set(written))
    assert count(db, fencing.OPERATION_TABLE) == len(rows)
    applied = {o["op"]: o for o in outcomes if o["kind"] == "applied"}
    assert set(applied) == set(written)
    first_writer = {row[3]: row[4] for row in rows}
    for o in outcomes:
        if o["kind"] == "stale":
            assert o["highest"] > o["token"]
        else:  # applied, or a replay answered with the first write's result
            assert o["op"] in first_writer, o
            assert o["result"] == {"writer": first_writer[o["op"]], "token": o["token"]}
    guard = guard_on(db)
    for key in keys:
        committed = [o["token"] for o in outcomes if o["key"] == key and o["kind"] != "stale"]
        assert guard.highest(NS, key) == max(committed)
    kinds = {kind: sum(o["kind"] == kind for o in outcomes) for kind in ("applied", "replayed", "stale")}
    print(f"\n{db.dialect}: {len(outcomes)} guarded calls from {writers} processes: {kinds}")
    assert kinds["stale"] > 0 and kinds["replayed"] > 0 and kinds["applied"] > 0  # the test exercised all three


def test_a_writer_killed_between_the_fence_update_and_the_write_leaves_nothing(fence_db: DB, tmp_path: Path) -> None:
    db = fence_db
    guard = guard_on(db)
    key = "object/crash"
    guard.write(NS, key, 5, "before", lambda conn: ledger_insert(db, conn, key, 5, "before", 0))
    marker = tmp_path / "inside"
    spec = {"mode": "crash", "db": db.to_json(), "namespace": NS, "key": key, "token": 9, "op": "crash-op"}
    proc = child({**spec, "marker": str(marker)}, tmp_path, "crash")
    deadline = time.monotonic() + 30
    while not marker.exists():  # the fence row is raised to 9 and the ledger row written, uncommitted
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL

    assert guard.highest(NS, key) == 5  # the raise did not survive
    assert [row[3] for row in ledger(db)] == ["before"]
    assert guard.recorded(NS, key, "crash-op") is None
    # The lock died with the writer: the same operation now goes through, once.
    assert guard.write(NS, key, 9, "crash-op", lambda conn: ledger_insert(db, conn, key, 9, "crash-op", 1)) is None
    assert guard.highest(NS, key) == 9
    assert [row[3] for row in ledger(db)] == ["before", "crash-op"]


def test_a_replayed_operation_returns_the_first_result_without_writing(fence_db: DB) -> None:
    db = fence_db
    guard = guard_on(db)
    calls: list[int] = []

    def write(token: int) -> Any:
        def fn(conn: Any) -> Any:
            calls.append(token)
            ledger_insert(db, conn, "k", token, "op-1", token)
            return {"written_by": token, "at": "first" if len(calls) == 1 else "again"}

        return fn

    first = guard.apply(NS, "k", 3, "op-1", write(3))
    same_token = guard.apply(NS, "k", 3, "op-1", write(3))
    newer_token = guard.apply(NS, "k", 4, "op-1", write(4))
    assert first.result == {"written_by": 3, "at": "first"} and not first.replayed
    assert same_token.result == first.result and same_token.replayed and same_token.token == 3
    assert newer_token.result == first.result and newer_token.replayed
    assert calls == [3]
    assert [row[3] for row in ledger(db)] == ["op-1"]
    assert guard.highest(NS, "k") == 4  # a replay under a newer token still raises the fence


def test_a_stale_token_raises_and_changes_nothing(fence_db: DB) -> None:
    db = fence_db
    guard = guard_on(db)
    guard.write(NS, "k", 7, "op-7", lambda conn: ledger_insert(db, conn, "k", 7, "op-7", 7))
    called = []
    with pytest.raises(fencing.StaleToken) as caught:
        guard.write(NS, "k", 6, "op-6", lambda conn: called.append(1))
    assert caught.value.token == 6 and caught.value.highest == 7
    assert "stale token 6" in str(caught.value) and "accepted token 7" in str(caught.value)
    # Even the replay of an applied operation is refused to a stale holder.
    with pytest.raises(fencing.StaleToken):
        guard.write(NS, "k", 6, "op-7", lambda conn: called.append(1))
    assert called == []
    assert guard.highest(NS, "k") == 7
    assert [row[3] for row in ledger(db)] == ["op-7"]
    assert count(db, fencing.OPERATION_TABLE) == 1


def test_an_exception_in_the_write_rolls_back_the_raise_and_the_write(fence_db: DB) -> None:
    db = fence_db
    guard = guard_on(db)

    def boom(conn: Any) -> Any:
        ledger_insert(db, conn, "k", 5, "op", 5)
        raise RuntimeError("the resource refused")

    with pytest.raises(RuntimeError):
        guard.write(NS, "k", 5, "op", boom)
    with pytest.raises(TypeError, match="JSON"):
        guard.write(NS, "k", 5, "op", lambda conn: ledger_insert(db, conn, "k", 5, "op", 5) or {1, 2})
    assert guard.highest(NS, "k") == 0
    assert ledger(db) == [] and count(db, fencing.OPERATION_TABLE) == 0


def test_the_lease_check_uses_the_databases_clock_with_the_margin(fence_db: DB) -> None:
    db = fence_db
    guard = fencing.Guard(db.connect(), lease_margin=1.0)
    now = datetime.datetime.now(datetime.UTC)
    with pytest.raises(fencing.LeaseExpired) as caught:
        guard.write(NS, "k", 2, "late", lambda conn: 1, lease_expires_at=now - datetime.timedelta(seconds=1))
    assert caught.value.margin == 1.0
    with pytest.raises(fencing.LeaseExpired):  # within the margin: refused early
        guard.write(NS, "k", 2, "late", lambda conn: 1, lease_expires_at=now + datetime.timedelta(seconds=0.5))
    assert guard.highest(NS, "k") == 0  # a refused write changes nothing either
    assert guard.write(NS, "k", 2, "ok", lambda conn: 1, lease_expires_at=now + datetime.timedelta(seconds=10)) == 1


def test_uint64_tokens_and_byte_exact_keys(fence_db: DB) -> None:
    db = fence_db
    guard = guard_on(db)
    top = 2**64 - 1
    guard.write(NS, "key", top - 1, "a", lambda conn: None)
    guard.write(NS, "key", top, "b", lambda conn: None)
    assert guard.highest(NS, "key") == top
    with pytest.raises(fencing.StaleToken):
        guard.write(NS, "key", top - 1, "c", lambda conn: None)
    # Composed and decomposed é, and case, are different keys (no normalisation, no folding).
    guard.write(NS, "caf\u00e9", 5, "x", lambda conn: None)
    assert guard.highest(NS, "cafe\u0301") == 0 and guard.highest(NS, "CAF\u00c9") == 0
    guard.write(NS, "cafe\u0301", 1, "x", lambda conn: None)
    assert guard.highest(NS, "caf\u00e9") == 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", "k", 1, "op"), "namespace"),
        ((NS, "k ", 1, "op"), "whitespace"),
        ((NS, "k", 0, "op"), "token"),
        ((NS, "k", True, "op"), "token"),
        ((NS, "k", 2**64, "op"), "token"),
        ((NS, "k" * 192, 1, "op"), "limit"),
        ((NS, "k", 1, "op\n"), "operation_id"),
    ],
)
def test_invalid_arguments_are_refused_before_any_statement(
    args: tuple[Any, ...], message: str, tmp_path: Path
) -> None:
    import sqlite3

    guard = fencing.Guard(sqlite3.connect(str(tmp_path / "none.sqlite3")))  # no tables: nothing may run
    with pytest.raises(ValueError, match=message):
        guard.write(*args, lambda conn: None)


def test_ddl_and_dialects() -> None:
    for dialect in fencing.DIALECTS:
        statements = fencing.ddl(dialect)
        assert any(fencing.FENCE_TABLE in s for s in statements)
        assert any(fencing.OPERATION_TABLE in s for s in statements)
    assert "utf8mb4_bin" in fencing.ddl("mysql")[0] and 'COLLATE "C"' in fencing.ddl("postgresql")[0]
    with pytest.raises(ValueError, match="dialect"):
        fencing.ddl("oracle")


def test_a_sqlite_connection_with_an_open_transaction_is_refused(tmp_path: Path) -> None:
    import sqlite3

    conn = sqlite3.connect(str(tmp_path / "open.sqlite3"))
    fencing.install(conn)
    conn.execute("CREATE TABLE t (x)")
    conn.execute("INSERT INTO t VALUES (1)")  # an implicit transaction, left open
    with pytest.raises(RuntimeError, match="open transaction"):
        fencing.Guard(conn).write(NS, "k", 1, "op", lambda c: None)


def test_the_sdk_imports_no_django_and_no_driver() -> None:
    code = (
        "import sys, orbit_sdk.fencing; "
        "bad = [m for m in ('django', 'psycopg', 'MySQLdb', 'pymysql') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ""}).returncode == 0

"""sdk/README.md's Fencing fragment (only type-checked elsewhere) serving real keyed
tasks, on SQLite; and the Guard on MariaDB under a key policy of capacity 2: never more than
two holders at once, each write fenced per (key, slot), every task SUCCEEDED once."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import orbit_sdk
from orbit_sdk import Client, Execution, SubmitTaskRequest, Worker, fencing
from tests.support.readme import python_blocks
from tests.support.sdk_live import finished, new_queue, worker_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def client(orbit_server: Any, tenant: Any) -> Iterator[Client]:
    with Client(orbit_server.url, tenant.token) as sdk:
        yield sdk


def serve(orbit_server: Any, tenant: Any, queue_id: str, handlers: dict[Any, Any], capacity: int) -> Worker:
    worker = worker_for(orbit_server.url, tenant, queue_id, handlers, capacity=capacity)
    worker.start()
    return worker


def test_the_readme_fencing_fragment_serves_keyed_tasks_on_sqlite(
    orbit_server: Any, tenant: Any, client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (code,) = [code for mark, code in python_blocks() if mark.startswith("a fragment: the handler of a keyed worker")]
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(code, "fencing_fragment.py", "exec"), namespace)  # as written: it makes resource.sqlite3 here
    queue_id = new_queue(client).id
    worker = serve(orbit_server, tenant, queue_id, {("update", "v1"): namespace["update"]}, 4)
    try:
        key = f"object/{uuid.uuid4().hex[:8]}"
        tasks = [
            client.submit_task(
                f"fence-{key}-{n}",
                SubmitTaskRequest(
                    queue_id,
                    "update",
                    "v1",
                    "v1",
                    {"ref": f"r{n}", "operation_ref": f"op-{n % 3}"},
                    concurrency_key=key,
                ),
            ).task
            for n in range(5)
        ]
        ended = [finished(client, task.id) for task in tasks]
    finally:
        worker.stop()
        worker.join(10)
    assert [task.state for task in ended] == ["SUCCEEDED"] * 5, [(t.state, t.last_error) for t in ended]
    assert all(task.output == {"state": "done"} for task in ended)
    import sqlite3

    with sqlite3.connect(tmp_path / "resource.sqlite3") as conn:
        refs = sorted(row[0] for row in conn.execute("SELECT ref FROM objects"))
        operations = conn.execute(f"SELECT count(*) FROM {fencing.OPERATION_TABLE}").fetchone()[0]
    assert refs == ["r0", "r1", "r2"]  # op-0 and op-1 came twice: the replays wrote nothing
    assert operations == 3


@pytest.mark.mysql_only
def test_the_guard_on_mariadb_under_a_capacity_two_key(orbit_server: Any, tenant: Any, client: Client) -> None:
    import MySQLdb
    from django.db import connection as django_connection

    settings = django_connection.settings_dict

    def connect() -> Any:
        return MySQLdb.connect(
            host=settings["HOST"] or "127.0.0.1",
            port=int(settings["PORT"] or 3306),
            user=settings["USER"],
            passwd=settings["PASSWORD"],
            db=settings["NAME"],
        )

    setup = connect()
    fencing.install(setup)
    try:
        prefix = f"printer-{uuid.uuid4().hex[:6]}/"
        policy = orbit_sdk.CreateKeyPolicyRequest(orbit_sdk.KeyMatch(prefix=prefix), "audit", capacity=2)
        client.create_key_policy(f"policy-{prefix}", policy)
        queue_id = new_queue(client).id
        lock = threading.Lock()
        holding: dict[int, int] = {}
        peak = [0]
        seen: list[tuple[int | None, int | None]] = []

        def write(execution: Execution) -> dict[str, Any]:
            with lock:
                assert execution.concurrency_slot not in holding, (execution.concurrency_slot, holding)
                holding[execution.concurrency_slot] = execution.concurrency_token  # type: ignore[index,assignment]
                peak[0] = max(peak[0], len(holding))
                seen.append((execution.concurrency_slot, execution.concurrency_token))
            conn = connect()
            try:
                time.sleep(0.3)

                def insert(c: Any) -> dict[str, int | None]:
                    return {"slot": execution.concurrency_slot}

                result: dict[str, Any] = (
                    fencing.Guard(conn).for_execution(execution).write(execution.attempt_id, insert)
                )
                return result
            finally:
                conn.close()
                with lock:
                    del holding[execution.concurrency_slot]  # type: ignore[arg-type]

        worker = serve(orbit_server, tenant, queue_id, {("write", "v1"): write}, 4)
        try:
            key = f"{prefix}1"
            tasks = [
                client.submit_task(
                    f"{key}-{n}", SubmitTaskRequest(queue_id, "write", "v1", "v1", {}, concurrency_key=key)
                ).task
                for n in range(6)
            ]
            ended = [finished(client, task.id) for task in tasks]
        finally:
            worker.stop()
            worker.join(10)
        assert [task.state for task in ended] == ["SUCCEEDED"] * 6, [(t.state, t.last_error) for t in ended]
        assert peak[0] == 2
        assert {slot for slot, _ in seen} == {0, 1}
        tokens = [token for _, token in seen]
        assert len(set(tokens)) == 6
        guard = fencing.Guard(setup)
        for slot in (0, 1):
            assert guard.highest(tenant.namespace_id, key, slot) == max(t for s, t in seen if s == slot)
    finally:
        cursor = setup.cursor()
        for statement in fencing.drop_ddl("mysql"):
            cursor.execute(statement)
        setup.commit()
        setup.close()

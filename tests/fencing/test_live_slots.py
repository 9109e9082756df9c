"""End to end against a live Orbit server (SPEC §12): a key of capacity 3, three tasks of it
run at once by one worker, each execution on its own concurrency_slot with its own token; the
key's page shows the three holders by slot, a fourth task is blocked KEY_AT_CAPACITY, and all
three write through the guard's for_execution, which fences each slot apart."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

import orbit_sdk
from orbit_sdk import fencing
from tests.support.api import make_queue
from tests.support.key_rows import make_policy
from tests.support.tasks import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "printer/live"


def submit(tenant: Any, queue_id: str, name: str) -> dict[str, Any]:
    body = {
        "queue_id": queue_id,
        "handler": "print",
        "handler_version": "v1",
        "payload_version": "v1",
        "payload": {"name": name},
        "concurrency_key": KEY,
    }
    response = tenant.client.post(
        "/v1/tasks", data=json.dumps(body), content_type="application/json", HTTP_IDEMPOTENCY_KEY=name
    )
    assert response.status_code == 201, response.content
    return response.json()["data"]["task"]


def get(tenant: Any, path: str) -> Any:
    response = tenant.client.get(path)
    assert response.status_code == 200, response.content
    return response.json()["data"]


def test_three_holders_of_a_capacity_3_key_run_at_once_and_all_write(
    tenant: Any, orbit_server: Any, tmp_path: Path
) -> None:
    make_policy(tenant.namespace, key=KEY, capacity=3)
    queue = make_queue(tenant.client, "printing", max_concurrency=10, rate_per_second=1000)
    resource = str(tmp_path / "printer.sqlite3")
    setup = sqlite3.connect(resource)
    fencing.install(setup)
    setup.execute("CREATE TABLE printed (id INTEGER PRIMARY KEY, slot INTEGER, token INTEGER)")
    setup.commit()
    setup.close()

    inside: list[tuple[int | None, int | None, str]] = []
    lock = threading.Lock()
    go = threading.Event()

    def print_job(execution: orbit_sdk.Execution) -> dict[str, Any]:
        with lock:
            inside.append((execution.concurrency_slot, execution.concurrency_token, execution.task.id))
        assert go.wait(30), "the test never let the handlers go"
        conn = sqlite3.connect(resource, timeout=30)
        try:
            guard = fencing.Guard(conn)

            def write(db: Any) -> int:
                db.execute(
                    "INSERT INTO printed (slot, token) VALUES (?, ?)",
                    (execution.concurrency_slot, execution.concurrency_token),
                )
                return int(execution.concurrency_token or 0)

            landed = guard.for_execution(execution, check_lease=False).write(f"print-{execution.task.id}", write)
        finally:
            conn.close()
        return {"slot": execution.concurrency_slot, "token": str(landed)}

    tasks = [submit(tenant, queue["id"], f"job-{n}") for n in range(3)]
    worker = orbit_sdk.Worker(
        orbit_server.url,
        tenant.token,
        [queue["id"]],
        {("print", "v1"): print_job},
        capacity=4,
        concurrency_keys=True,
        namespace_id=tenant.namespace_id,
    )
    worker.start()
    try:
        wait_until(lambda: len(inside) == 3, 20)  # three handlers hold the key at once
        slots = sorted(slot for slot, _token, _task in inside if slot is not None)
        assert slots == [0, 1, 2]
        key = get(tenant, "/v1/concurrency-keys/" + quote(KEY, safe=""))
        assert key["capacity"] == 3 and "holder" not in key
        assert sorted((h["slot"], int(h["token"]), h["task_id"]) for h in key["holders"]) == sorted(
            (slot, token, task) for slot, token, task in inside
        )
        fourth = submit(tenant, queue["id"], "job-3")
        codes = [item["code"] for item in get(tenant, f"/v1/tasks/{fourth['id']}/blockers")["items"]]
        assert "KEY_AT_CAPACITY" in codes
        go.set()
        for task in [*tasks, fourth]:
            wait_until(lambda task=task: get(tenant, f"/v1/tasks/{task['id']}")["state"] == "SUCCEEDED", 20)
    finally:
        go.set()
        worker.stop(timeout=5)
        worker.join(timeout=10)

    check = sqlite3.connect(resource)
    try:
        printed = check.execute("SELECT slot, token FROM printed ORDER BY id").fetchall()
        fences = dict(check.execute("SELECT slot, CAST(highest_token AS INTEGER) FROM orbit_fence_slot").fetchall())
        key_wide = check.execute("SELECT COUNT(*) FROM orbit_fence").fetchone()[0]
    finally:
        check.close()
    # every holder's write landed, older tokens of other slots too; each slot's fence is its newest
    assert len(printed) == 4 and key_wide == 0
    by_slot: dict[int, int] = {}
    for slot, token in printed:
        by_slot[slot] = max(by_slot.get(slot, 0), token)
    assert fences == by_slot

"""A move between cells (SPEC §14): what a tenant's clients hold
across `orbit_move_application` (receipts, dependencies, event cursors, a
plan's trigger pages) and what a tenant of another cell may see."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from typing import Any

import httpx

from orbit_sdk import Worker
from tests.support.cells import CELL_A_DB, MARKS, Installation, shared_connection

pytestmark = MARKS

TASK = {"handler": "h", "handler_version": "v1", "payload_version": "v1"}


class Tenant:
    def __init__(self, installation: Installation, credential: dict[str, Any]) -> None:
        assert installation.server is not None
        self.url = installation.server.url
        self.credential = credential
        self.headers = {"Authorization": f"Bearer {credential['token']}"}

    def get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", params=params, headers=self.headers, timeout=30)

    def post(self, path: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
        headers = {**self.headers, **({"Idempotency-Key": key} if key else {})}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=30)

    def submit(self, key: str, **fields: Any) -> httpx.Response:
        body = {"queue_id": self.credential["queue_id"], **TASK, "payload": {"key": key}, **fields}
        return self.post("/v1/tasks", body, key)


def without_request_id(answer: httpx.Response) -> tuple[int, Any]:
    body = answer.json()
    body.pop("request_id", None)
    return answer.status_code, body


def all_triggers(tenant: Tenant, plan_id: str) -> list[dict[str, Any]]:
    items, token = [], ""
    while True:
        page = tenant.get(f"/v1/plans/{plan_id}/triggers", page_size=100, **({"page_token": token} if token else {}))
        assert page.status_code == 200, page.text
        items += page.json()["data"]["items"]
        token = page.json()["data"]["next_page_token"]
        if not token:
            return items


def test_a_move_keeps_receipts_dependencies_cursors_and_trigger_pages(installation: Installation) -> None:
    credential = installation.bootstrap("audmove", "b")
    plans_file = installation.tmp / "audmove-plans.json"
    installation.manage(
        "orbit_credential", "create", "--application", "audmove", "--namespace", "n", "--environment", "e",
        "--scopes", "plans:manage,tasks:read,queues:read,tasks:submit", "--queues", "all",
        "--output", str(plans_file),
    )  # fmt: skip
    tenant = Tenant(installation, credential)
    planner = Tenant(installation, {**credential, **json.loads(plans_file.read_text())})
    alpha = Tenant(installation, installation.credentials["alpha"])

    # A cell restarted by an earlier test may fail a request on each stale pooled connection
    # (503, retry): wait until it serves, as a client retrying would.
    deadline = time.monotonic() + 30
    while (parent := tenant.submit("audmove-parent")).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert parent.status_code == 201, parent.text
    parent_id = parent.json()["data"]["task"]["id"]
    child = tenant.submit("audmove-child", depends_on=[parent_id])
    assert child.status_code == 201, child.text
    child_id = child.json()["data"]["task"]["id"]
    plan = planner.post(
        "/v1/plans",
        {
            "name": "every-second",
            "queue_id": credential["queue_id"],
            "schedule": {"interval_seconds": 1},
            "misfire": {"policy": "CATCH_UP", "catch_up_window_seconds": 600},
            "definition": {"task": {**TASK, "payload": {}}},
        },
        "audmove-plan",
    )
    assert plan.status_code == 201, plan.text
    plan_id = plan.json()["data"]["plan"]["id"]
    # The move's start-up overlaps the plan's first points; it begins after the reads below.
    move = installation.prestart("orbit_move_application", "audmove", "--to", "a", "--timeout", "30")
    deadline = time.monotonic() + 20
    while len(all_triggers(planner, plan_id)) < 3:
        assert time.monotonic() < deadline, "the plan did not fire"
        time.sleep(0.3)
    first_page = planner.get(f"/v1/plans/{plan_id}/triggers", page_size=1).json()["data"]
    token, first_point = first_page["next_page_token"], first_page["items"][0]["scheduled_at"]
    events = planner.get("/v1/events", page_size=500).json()["data"]
    cursor = int(events["next_cursor"])

    # Cross-cell: alpha (cell a) names audmove's rows (cell b) exactly as unknown ids.
    unknown_id = "0" * 32
    for foreign_id, path in ((parent_id, "/v1/tasks/{}"), (parent_id, "/v1/tasks/{}/attempts"),
                             (credential["queue_id"], "/v1/queues/{}"), (plan_id, "/v1/plans/{}")):  # fmt: skip
        foreign, unknown = alpha.get(path.format(foreign_id)), alpha.get(path.format(unknown_id))
        assert foreign.status_code == unknown.status_code and foreign.status_code in (403, 404), (path, foreign.text)
        assert without_request_id(foreign)[1] == json.loads(
            json.dumps(without_request_id(unknown)[1]).replace(unknown_id, foreign_id)
        ), (path, foreign.text, unknown.text)
    dep_foreign = alpha.submit("alpha-dep-foreign", depends_on=[parent_id])
    dep_unknown = alpha.submit("alpha-dep-unknown", depends_on=[unknown_id])
    assert without_request_id(dep_foreign) == without_request_id(dep_unknown), (dep_foreign.text, dep_unknown.text)

    # A busier target: its auto-increment counters are above the source's (as any older cell's are).
    shared = shared_connection()
    try:
        shared.cursor().execute(f"ALTER TABLE `{CELL_A_DB}`.orbit_plan_trigger AUTO_INCREMENT = 1000000")
    finally:
        shared.close()
    moved = move.run()
    assert "now served from cell a" in moved.stdout, moved.stdout

    def served(answer_of: Any) -> httpx.Response:
        deadline = time.monotonic() + 10
        while (answer := answer_of()).status_code == 503:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        return answer

    # The replay of an accepted submit answers its original receipt.
    replay = served(lambda: tenant.submit("audmove-parent"))
    assert replay.status_code == 200 and replay.json()["data"]["task"]["id"] == parent_id, replay.text
    # The event log goes on from the cursor read before the move, with no gap and nothing twice.
    after = served(lambda: planner.get("/v1/events", after=str(cursor), page_size=500)).json()["data"]["items"]
    seqs = [int(item["cursor"]) for item in after]
    assert seqs == list(range(cursor + 1, cursor + 1 + len(seqs))), seqs[:10]
    # Every point of the plan is recorded once, before and after the move.
    triggers = all_triggers(planner, plan_id)
    points = [item["scheduled_at"] for item in triggers]
    assert len(points) == len(set(points)) and points == sorted(points), points
    gaps = {
        (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()
        for a, b in zip(points, points[1:], strict=False)
    }
    assert gaps == {1.0}, points  # CATCH_UP: no point missed across the move
    for item in triggers:
        if "task_id" in item:
            assert tenant.get(f"/v1/tasks/{item['task_id']}").status_code == 200, item

    # The dependency still holds, and is released once its parent succeeds in the new cell.
    assert tenant.get(f"/v1/tasks/{child_id}").json()["data"]["state"] == "BLOCKED"
    worker = Worker(installation.server.url, credential["token"], [credential["queue_id"]], {"h": lambda _: None}, 4)  # type: ignore[union-attr]
    threading.Thread(target=worker.run, kwargs={"handle_signals": False}, daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        while tenant.get(f"/v1/tasks/{child_id}").json()["data"]["state"] != "SUCCEEDED":
            assert time.monotonic() < deadline, tenant.get(f"/v1/tasks/{child_id}").text
            time.sleep(0.2)
    finally:
        worker.stop()
    assert tenant.get(f"/v1/tasks/{parent_id}").json()["data"]["state"] == "SUCCEEDED"
    # A page token handed out before the move reads on after the point it stopped at.
    next_page = planner.get(f"/v1/plans/{plan_id}/triggers", page_size=100, page_token=token).json()["data"]
    assert next_page["items"] and next_page["items"][0]["scheduled_at"] > first_point, (first_point, next_page)

"""Real resources on a live server for the contract run: queues, tasks in
each state an operation needs, attempts, plans, and their current revisions,
made over the HTTP API and the worker protocol as a caller would."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from tests.support.live import WorkerConnection

TASK_BODY = {"handler": "contract", "handler_version": "v1", "payload_version": "v1", "payload": {"n": 1}}
PLAN_BODY = {
    "schedule": {"interval_seconds": 3600},
    "misfire": {"policy": "SKIP"},
    "definition": {"task": TASK_BODY},
}


def fresh_key() -> str:
    return f"contract-{uuid.uuid4().hex}"


class World:
    """One tenant's resources on the live server, made on first use."""

    def __init__(self, url: str, token: str, application_id: str) -> None:
        self.url = url
        self.token = token
        self.application_id = application_id
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        self.named: dict[str, str] = {}
        self.worker: WorkerConnection | None = None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.http.close()

    def post(self, path: str, body: dict[str, Any], expect: tuple[int, ...] = (200, 201)) -> dict[str, Any]:
        response = self.http.post(path, json=body, headers={"Idempotency-Key": fresh_key()})
        assert response.status_code in expect, (path, response.status_code, response.text)
        return response.json()["data"]

    def get(self, path: str) -> dict[str, Any]:
        response = self.http.get(path)
        assert response.status_code == 200, (path, response.text)
        return response.json()["data"]

    def revision(self, path: str) -> str:
        data = self.get(path)
        return data["revision"]

    # ------------------------------------------------------------------ queues

    def new_queue(self, **limits: Any) -> dict[str, Any]:
        body = {"name": f"q-{uuid.uuid4().hex[:12]}", "max_concurrency": 8, "rate_per_second": 1000, **limits}
        return self.post("/v1/queues", body)["queue"]

    def queue(self, purpose: str) -> str:
        if purpose not in self.named:
            self.named[purpose] = self.new_queue()["id"]
        return self.named[purpose]

    def retirable_queue(self) -> tuple[str, str]:
        """A paused, empty queue: its id and revision."""
        queue = self.new_queue()
        body = {
            "expected_revision": queue["revision"],
            "reason": "contract: pause before retire",
            "paused": True,
            "max_concurrency": 8,
            "rate_per_second": 1000,
            "max_unfinished_tasks": 1000,
        }
        paused = self.post(f"/v1/queues/{queue['id']}:configure", body)["queue"]
        return paused["id"], paused["revision"]

    # ------------------------------------------------------------------ tasks

    def new_task(self, queue_purpose: str = "tasks") -> str:
        body = {**TASK_BODY, "queue_id": self.queue(queue_purpose)}
        return self.post("/v1/tasks", body)["task"]["id"]

    def task(self, purpose: str) -> str:
        key = f"task:{purpose}"
        if key not in self.named:
            self.named[key] = self.new_task()
        return self.named[key]

    def _worked(self, outcome: str) -> tuple[str, str]:
        """A task leased, started and reported with `outcome` by a worker:
        (task id, attempt id)."""
        queue_id = self.new_queue()["id"]  # its own: a task resolved RETRY waits again in the last one
        task_id = self.post("/v1/tasks", {**TASK_BODY, "queue_id": queue_id})["task"]["id"]
        worker = WorkerConnection(self.url, self.token)
        try:
            worker.hello([queue_id], capacity=1, worker_id=f"contract-{uuid.uuid4().hex[:8]}")
            assignment = worker.next_assignment(timeout=10)
            assert assignment is not None and assignment["task"]["id"] == task_id, assignment
            start = worker.request("task.start", attempt_id=assignment["attempt_id"], epoch=assignment["epoch"])
            assert start["type"] == "task.start.ok", start
            done = worker.request(
                "task.result", attempt_id=assignment["attempt_id"], epoch=assignment["epoch"], outcome=outcome
            )
            assert done["type"] == "task.result.ok", done
        finally:
            worker.close()
        return task_id, assignment["attempt_id"]

    def attempt(self) -> str:
        if "attempt" not in self.named:
            self.named["worked_task"], self.named["attempt"] = self._worked("SUCCEEDED")
        return self.named["attempt"]

    def worked_task(self) -> str:
        self.attempt()
        return self.named["worked_task"]

    def task_needing_review(self) -> str:
        return self._worked("UNKNOWN")[0]

    # ------------------------------------------------------------------ plans

    def new_plan(self, paused: bool = False) -> tuple[str, str]:
        body = {**PLAN_BODY, "name": f"p-{uuid.uuid4().hex[:12]}", "queue_id": self.queue("plans")}
        plan = self.post("/v1/plans", body)["plan"]
        if paused:
            plan = self.post(
                f"/v1/plans/{plan['id']}:pause", {"expected_revision": plan["revision"], "reason": "contract"}
            )["plan"]
        return plan["id"], plan["revision"]

    def plan(self, purpose: str) -> str:
        key = f"plan:{purpose}"
        if key not in self.named:
            self.named[key] = self.new_plan()[0]
        return self.named[key]

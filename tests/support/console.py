"""The console tests' world: tenants with queues, a keyed task running, one
blocked behind its key, a backlog, and a paused queue."""

from __future__ import annotations

from typing import Any

from tests.conftest import api_client
from tests.support.api import make_queue
from tests.support.factories import NamespaceFactory, make_credential
from tests.support.tasks import configure_queue, lease_one, run_threads, start, submit_ok


class Tenant:
    def __init__(self) -> None:
        self.namespace = NamespaceFactory()
        self.namespace_id = self.namespace.id
        self.token = make_credential(self.namespace).token
        self.client = api_client(self.token)


def busy_world() -> dict[str, Any]:
    """Made on a thread of its own: the API's in-process views cannot run on
    this one, where Playwright's event loop runs."""
    return run_threads(1, lambda _: make_world())[0]


def make_world() -> dict[str, Any]:
    """Two queues: one with a keyed task running and a sibling blocked behind
    its key, plus a backlog; one paused with a task waiting."""
    tenant = Tenant()
    billing = make_queue(tenant.client, "billing", max_concurrency=4, rate_per_second=20)
    held = submit_ok(tenant.client, billing["id"], "held", concurrency_key="acct/42", payload={"invoice": 7})
    lease = lease_one(tenant, billing["id"], worker_id="worker-1")
    start(lease)
    blocked = submit_ok(tenant.client, billing["id"], "blocked", concurrency_key="acct/42")
    for n in range(5):
        submit_ok(tenant.client, billing["id"], f"backlog-{n}")
    reports = make_queue(tenant.client, "reports", max_concurrency=2, rate_per_second=5)
    paused_task = submit_ok(tenant.client, reports["id"], "report-1")
    configure_queue(tenant.client, reports["id"], paused=True)
    return {"tenant": tenant, "billing": billing, "held": held, "blocked": blocked, "paused_task": paused_task}

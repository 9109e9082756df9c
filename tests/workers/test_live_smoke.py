import pytest

from tests.support.api import make_queue
from tests.support.live import WorkerConnection
from tests.support.workers import submit

pytestmark = pytest.mark.django_db(transaction=True)


def test_orbit_server_leases_and_completes(tenant, orbit_server):
    queue = make_queue(tenant.client)
    task = submit(tenant, queue["id"], "live-1")
    worker = WorkerConnection(orbit_server.url, tenant.token)
    worker.hello([queue["id"]], capacity=2, worker_id="live-w1")
    assign = worker.next_assignment(timeout=5)
    assert assign is not None and assign["task"]["id"] == task["id"]
    start = worker.request("task.start", attempt_id=assign["attempt_id"], epoch=assign["epoch"])
    assert start["type"] == "task.start.ok", start
    done = worker.request("task.result", attempt_id=assign["attempt_id"], epoch=assign["epoch"], outcome="SUCCEEDED")
    assert done["task_state"] == "SUCCEEDED"
    worker.close()

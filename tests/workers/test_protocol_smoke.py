import pytest

from tests.support.api import make_queue
from tests.support.workers import ProtocolClient, submit

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


async def test_lease_start_result_roundtrip(tenant):
    from asgiref.sync import sync_to_async

    queue = await sync_to_async(make_queue)(tenant.client)
    task = await sync_to_async(submit)(tenant, queue["id"], "t1")
    worker = ProtocolClient(tenant.token)
    await worker.connect()
    hello = await worker.hello([queue["id"]])
    assert hello["type"] == "hello.ok", hello
    assign = await worker.next_assignment()
    assert assign["task"]["id"] == task["id"]
    start = await worker.request("task.start", attempt_id=assign["attempt_id"], epoch=assign["epoch"])
    assert start["type"] == "task.start.ok" and start["attempt_number"] == 1, start
    result = await worker.request(
        "task.result", attempt_id=assign["attempt_id"], epoch=assign["epoch"], outcome="SUCCEEDED", output={"ok": 1}
    )
    assert result == {
        "type": "task.result.ok",
        "reply_to": result["reply_to"],
        "task_state": "SUCCEEDED",
        "duplicate": False,
        "late": False,
    }
    again = await worker.request(
        "task.result", attempt_id=assign["attempt_id"], epoch=assign["epoch"], outcome="SUCCEEDED", output={"ok": 1}
    )
    assert again["duplicate"] is True
    await worker.close()
    detail = await sync_to_async(tenant.client.get)(f"/v1/tasks/{task['id']}")
    assert detail.json()["data"]["state"] == "SUCCEEDED"
    q = await sync_to_async(tenant.client.get)(f"/v1/queues/{queue['id']}")
    assert q.json()["data"]["unfinished_tasks"] == "0"

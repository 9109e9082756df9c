"""Every HTTP error of the real server reaches a Client (and an AsyncClient) as a typed
APIError with the documented code, status, message (naming the field), request id and
retry_after; QUEUE_FULL's re-send with the same key makes exactly one task."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Iterator
from typing import Any

import pytest

import orbit_sdk
from orbit_sdk import APIError, AsyncClient, Client, SubmitTaskRequest
from tests.conftest import new_tenant
from tests.support.sdk_live import new_queue

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def client(orbit_server: Any, tenant: Any) -> Iterator[Client]:
    with Client(orbit_server.url, tenant.token) as sdk:
        yield sdk


def raised(call: Any, *args: Any, **kwargs: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        call(*args, **kwargs)
    error = caught.value
    assert len(error.request_id) == 32, error
    assert error.message
    return error


def test_each_error_is_a_typed_api_error(orbit_server, client):
    queue = new_queue(client)
    request = SubmitTaskRequest(queue.id, "h", "v1", "v1", {})

    error = raised(client.submit_task, "k", SubmitTaskRequest(queue.id, "h", "v1", "v1", {}, priority=10))
    assert (error.code, error.status_code) == ("INVALID_ARGUMENT", 400) and "priority" in error.message

    with Client(orbit_server.url, "orb_00000000000000000000000000000000_nope") as stranger:
        error = raised(stranger.get_queue, queue.id)
    assert (error.code, error.status_code) == ("UNAUTHENTICATED", 401)

    reader = new_tenant(scopes=["tasks:read"])
    with Client(orbit_server.url, reader.token) as read_only:
        error = raised(read_only.submit_task, "k-reader", request)
    assert (error.code, error.status_code) == ("PERMISSION_DENIED", 403)

    error = raised(client.get_task, "0" * 32)
    assert (error.code, error.status_code) == ("NOT_FOUND", 404)

    client.submit_task("same-key", request)
    other = SubmitTaskRequest(queue.id, "h", "v1", "v1", {"other": True})
    error = raised(client.submit_task, "same-key", other)
    assert (error.code, error.status_code) == ("IDEMPOTENCY_CONFLICT", 409)

    stale = orbit_sdk.ConfigureQueueRequest(
        expected_revision=queue.revision + 5,
        reason="audit",
        paused=False,
        max_concurrency=8,
        rate_per_second=1000,
        max_unfinished_tasks=100,
    )
    error = raised(client.configure_queue, queue.id, "stale-configure", stale)
    assert (error.code, error.status_code) == ("STATE_CONFLICT", 409)

    big = SubmitTaskRequest(queue.id, "h", "v1", "v1", {"blob": "x" * 300_000})
    error = raised(client.submit_task, "big", big)
    assert (error.code, error.status_code) == ("PAYLOAD_TOO_LARGE", 413)

    huge = SubmitTaskRequest(queue.id, "h", "v1", "v1", {"blob": "x" * (5 * 1024 * 1024)})
    error = raised(client.submit_task, "huge", huge)
    assert (error.code, error.status_code) == ("PAYLOAD_TOO_LARGE", 413)
    # the client is still usable after the server refused a body it did not read
    assert client.get_queue(queue.id).id == queue.id


def test_queue_full_carries_retry_after_and_the_same_key_makes_one_task(client):
    queue = new_queue(client, max_unfinished_tasks=1)
    first = client.submit_task("first", SubmitTaskRequest(queue.id, "h", "v1", "v1", {})).task
    request = SubmitTaskRequest(queue.id, "h", "v1", "v1", {"n": 2})
    error = raised(client.submit_task, "second", request)
    assert (error.code, error.status_code) == ("QUEUE_FULL", 429)
    assert error.retry_after == datetime.timedelta(seconds=1)
    client.cancel_task(first.id, "cancel-first", "make room")
    accepted = client.submit_task("second", request)
    again = client.submit_task("second", request)
    assert not accepted.deduplicated and again.deduplicated and again.task.id == accepted.task.id
    ids = {task.id for task in client.list_tasks(queue_id=queue.id).items}
    assert ids == {first.id, accepted.task.id}


def test_the_async_client_raises_the_same_errors(orbit_server, tenant):
    async def scenario() -> None:
        async with AsyncClient(orbit_server.url, tenant.token) as client:
            with pytest.raises(APIError) as caught:
                await client.get_task("0" * 32)
            assert (caught.value.code, caught.value.status_code) == ("NOT_FOUND", 404)
        async with AsyncClient(orbit_server.url, "orb_x_y") as stranger:
            with pytest.raises(APIError) as caught:
                await stranger.get_task("0" * 32)
            assert caught.value.code == "UNAUTHENTICATED"

    asyncio.run(scenario())

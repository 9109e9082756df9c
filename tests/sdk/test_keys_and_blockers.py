"""get_task_blockers, list_concurrency_keys and get_concurrency_key against a live server,
on both clients: a held key and the task waiting for it, pages of keys, keys no URL could
carry as typed, and 404s."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from orbit_sdk import APIError, AsyncClient, Client, ConcurrencyKey, TaskBlockers
from tests.support.api import make_queue
from tests.support.keys import Worker, submit
from tests.support.tasks import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

# Characters a path would otherwise read as structure (or drop): each must reach the server as
# part of the one key, compared byte for byte.
UNSAFE_KEYS = ["object/42", "a b?c#d&e=f", "100%", "..", ".", "Ünïcode/ключ", "a/../b", "x%2Fy"]


@pytest.fixture
def worker(orbit_server: Any, tenant: Any) -> Iterator[Worker]:
    connection = Worker(orbit_server.url, tenant.token)
    try:
        yield connection
    finally:
        with contextlib.suppress(Exception):  # already closed by the test
            connection.close()


@pytest.fixture
def client(orbit_server: Any, tenant: Any) -> Iterator[Client]:
    with Client(orbit_server.url, tenant.token) as sdk:
        yield sdk


def on_async_client(orbit_server: Any, token: str, name: str, *args: Any, **kwargs: Any) -> Any:
    async def call() -> Any:
        async with AsyncClient(orbit_server.url, token) as sdk:
            return await getattr(sdk, name)(*args, **kwargs)

    return asyncio.run(call())


def test_a_task_waiting_for_a_held_key_shows_key_held_with_the_holder(orbit_server, tenant, worker, client):
    # given a keyed task leased by a worker that holds on to it, and a second task of that key
    queue = make_queue(tenant.client, "blockers", rate_per_second=1000)
    first = submit(tenant, queue["id"], "b-1", concurrency_key="object/7")
    worker.hello([queue["id"]], capacity=2, worker_id="w-blockers")
    assign = worker.expect_assignment()
    assert assign["task"]["id"] == first["id"]
    second = submit(tenant, queue["id"], "b-2", concurrency_key="object/7")

    # when the SDK asks why the second is not running, and reads the key
    blockers = client.get_task_blockers(second["id"])
    key = client.get_concurrency_key("object/7")

    # then the one blocker is KEY_HELD, naming the holder's attempt, task and worker
    assert isinstance(blockers, TaskBlockers) and blockers.state == "WAITING"
    (held,) = [blocker for blocker in blockers.items if blocker.code == "KEY_HELD"]
    assert [blocker.code for blocker in blockers.items] == ["KEY_HELD"], blockers
    assert held.message and held.facts["attempt_id"] == assign["attempt_id"]
    assert held.facts["task_id"] == first["id"] and held.facts["worker_id"] == "w-blockers"
    # and the key has that holder, its token, and one task waiting
    assert isinstance(key, ConcurrencyKey) and key.key == "object/7" and key.waiting_tasks == 1
    assert key.holder is not None and key.holder.attempt_id == assign["attempt_id"]
    assert key.holder.task_id == first["id"] and key.holder.worker_id == "w-blockers"
    assert key.holder.token == int(assign["concurrency_token"]) == key.highest_token
    # and the leased task itself has no blocker: it is not WAITING
    assert client.get_task_blockers(first["id"]) == TaskBlockers(state="LEASED", items=[])
    # and the async client reads the same
    assert on_async_client(orbit_server, tenant.token, "get_task_blockers", second["id"]) == blockers
    assert on_async_client(orbit_server, tenant.token, "get_concurrency_key", "object/7") == key

    # when the holder finishes, and the waiting task takes the key
    worker.finish(assign)
    nxt = worker.expect_assignment()
    # then its token is above the first, not next to it: the release advanced the key too
    assert nxt["task"]["id"] == second["id"] and int(nxt["concurrency_token"]) == key.highest_token + 2
    assert client.get_concurrency_key("object/7").highest_token == key.highest_token + 2
    worker.finish(nxt)
    done = wait_until(lambda: (k := client.get_concurrency_key("object/7")).holder is None and k, 5)
    assert done.highest_token == key.highest_token + 3 and done.waiting_tasks == 0


def test_keys_come_in_pages_in_byte_order_under_a_prefix(orbit_server, tenant, worker, client):
    # given five keys that each leased once (a key's row is made by its first lease), and one other
    queue = make_queue(tenant.client, "pages", rate_per_second=1000)
    names = ["page/B", "page/a", "page/c", "page/d", "page/e"]
    for index, name in enumerate([*names, "other/1"]):
        submit(tenant, queue["id"], f"p-{index}", concurrency_key=name)
    worker.hello([queue["id"]], capacity=8, worker_id="w-pages")
    for _ in range(6):
        worker.finish(worker.expect_assignment())

    # when the SDK reads them two at a time under the prefix, on both clients
    seen: list[list[str]] = []
    token: str | None = None
    while True:
        page = client.list_concurrency_keys(prefix="page/", page_size=2, page_token=token)
        same = on_async_client(orbit_server, tenant.token, "list_concurrency_keys", "page/", 2, token)
        assert same == page
        seen.append([key.key for key in page.items])
        token = page.next_page_token
        if token is None:
            break

    # then every key of the prefix comes once, in byte order ("B" before "a"), and no other
    assert seen == [["page/B", "page/a"], ["page/c", "page/d"], ["page/e"]]
    every = client.list_concurrency_keys().items
    assert [key.key for key in every] == sorted([*names, "other/1"])
    assert all(key.holder is None and key.highest_token == 2 and key.updated_at for key in every)


def test_a_key_no_url_could_carry_as_typed_is_read_byte_for_byte(orbit_server, tenant, worker, client):
    # given keys with "/", "?", "#", "%", spaces, dots and non-ASCII, each leased once
    queue = make_queue(tenant.client, "unsafe", rate_per_second=1000)
    for index, name in enumerate(UNSAFE_KEYS):
        submit(tenant, queue["id"], f"u-{index}", concurrency_key=name)
    worker.hello([queue["id"]], capacity=len(UNSAFE_KEYS), worker_id="w-unsafe")
    for _ in UNSAFE_KEYS:
        worker.finish(worker.expect_assignment())
    # then each reads back as itself, the list has each, and a key differing in case is another key
    for name in UNSAFE_KEYS:
        assert client.get_concurrency_key(name).key == name, name
        assert on_async_client(orbit_server, tenant.token, "get_concurrency_key", name).key == name, name
    assert {key.key for key in client.list_concurrency_keys(page_size=100).items} == set(UNSAFE_KEYS)
    with pytest.raises(APIError) as upper:
        client.get_concurrency_key("OBJECT/42")
    assert upper.value.code == "NOT_FOUND" and upper.value.status_code == 404


def test_unknown_keys_and_tasks_are_the_sdks_not_found(orbit_server, tenant, client):
    for call in (
        lambda: client.get_concurrency_key("never/leased"),
        lambda: client.get_task_blockers("0" * 32),
    ):
        with pytest.raises(APIError) as raised:
            call()
        assert raised.value.code == "NOT_FOUND" and raised.value.status_code == 404 and raised.value.request_id
    with pytest.raises(APIError) as raised:
        on_async_client(orbit_server, tenant.token, "get_concurrency_key", "never/leased")
    assert raised.value.code == "NOT_FOUND" and raised.value.status_code == 404
    # An empty key names no key at all: refused before anything is sent.
    with pytest.raises(ValueError):
        client.get_concurrency_key("")

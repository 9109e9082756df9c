"""The key policy verbs of both SDK clients against a live server (SPEC §12):
create, replay, get, list, configure, retire, and the server's refusals as APIError."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from orbit_sdk import (
    APIError,
    AsyncClient,
    Client,
    ConfigureKeyPolicyRequest,
    CreateKeyPolicyRequest,
    KeyMatch,
    KeyPolicy,
    KeyRate,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def client(orbit_server: Any, tenant: Any) -> Iterator[Client]:
    with Client(orbit_server.url, tenant.token) as sdk:
        yield sdk


def test_create_replay_get_configure_retire(client, tenant):
    request = CreateKeyPolicyRequest(
        KeyMatch(prefix="customer/"), "tenants share a ledger", capacity=5, rate=KeyRate(10, 60, 2)
    )
    created = client.create_key_policy("policy-1", request)
    assert created.deduplicated is False
    policy = created.policy
    assert isinstance(policy, KeyPolicy) and policy.namespace_id == tenant.namespace_id
    assert policy.match == KeyMatch(prefix="customer/") and policy.capacity == 5
    assert policy.rate == KeyRate(10, 60, 2) and policy.revision == 1 and policy.retired_at is None
    replay = client.create_key_policy("policy-1", request)
    assert replay.deduplicated is True and replay.policy == policy
    assert client.get_key_policy(policy.id) == policy

    configured = client.configure_key_policy(policy.id, "policy-2", ConfigureKeyPolicyRequest(1, "no rate", 3)).policy
    assert configured.capacity == 3 and configured.rate is None and configured.revision == 2

    with pytest.raises(APIError) as stale:
        client.configure_key_policy(policy.id, "policy-3", ConfigureKeyPolicyRequest(1, "stale", 4))
    assert stale.value.code == "STATE_CONFLICT" and stale.value.status_code == 409

    retired = client.retire_key_policy(policy.id, "policy-4", 2, "moved").policy
    assert retired.retired_at is not None and retired.revision == 3
    # its match is free again
    again = client.create_key_policy("policy-5", CreateKeyPolicyRequest(KeyMatch(prefix="customer/"), "back"))
    assert again.policy.capacity == 1 and again.policy.rate is None


def test_list_pages_and_refusals(client):
    ids = [
        client.create_key_policy(f"k-{n}", CreateKeyPolicyRequest(KeyMatch(key=f"k/{n}"), "r")).policy.id
        for n in range(3)
    ]
    first = client.list_key_policies(page_size=2)
    assert [p.id for p in first.items] == sorted(ids)[:2] and first.next_page_token
    rest = client.list_key_policies(page_size=2, page_token=first.next_page_token)
    assert [p.id for p in rest.items] == sorted(ids)[2:] and rest.next_page_token is None
    with pytest.raises(APIError) as taken:
        client.create_key_policy("k-dup", CreateKeyPolicyRequest(KeyMatch(key="k/0"), "r"))
    assert taken.value.code == "STATE_CONFLICT"
    with pytest.raises(APIError) as invalid:
        client.create_key_policy("k-big", CreateKeyPolicyRequest(KeyMatch(key="k/big"), "r", capacity=1001))
    assert invalid.value.code == "INVALID_ARGUMENT" and invalid.value.message.startswith("capacity:")
    with pytest.raises(APIError) as missing:
        client.get_key_policy("0" * 32)
    assert missing.value.code == "NOT_FOUND"
    with pytest.raises(ValueError):
        client.create_key_policy("k-both", CreateKeyPolicyRequest(KeyMatch(key="a", prefix="b"), "r"))


def test_the_async_client_has_the_same_verbs(orbit_server, tenant):
    async def run() -> tuple[Any, ...]:
        async with AsyncClient(orbit_server.url, tenant.token) as sdk:
            created = await sdk.create_key_policy("a-1", CreateKeyPolicyRequest(KeyMatch(key="ledger"), "r"))
            policy_id = created.policy.id
            got = await sdk.get_key_policy(policy_id)
            page = await sdk.list_key_policies()
            configured = await sdk.configure_key_policy(
                policy_id, "a-2", ConfigureKeyPolicyRequest(1, "r", 2, KeyRate(1, 1, 1))
            )
            retired = await sdk.retire_key_policy(policy_id, "a-3", 2, "r")
            return created, got, page, configured, retired

    created, got, page, configured, retired = asyncio.run(run())
    assert got == created.policy and [p.id for p in page.items] == [got.id]
    assert configured.policy.rate == KeyRate(1, 1, 1) and configured.policy.capacity == 2
    assert retired.policy.retired_at is not None

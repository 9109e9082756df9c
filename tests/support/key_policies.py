"""Key policy calls over the API (SPEC §12), shared by the key policy suites."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from tasks.models import ConcurrencyKey
from tests.conftest import post_json
from tests.support.api import assert_ok

POLICIES = "/v1/key-policies"


def create_body(match: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    return {"match": match or {"prefix": "customer/"}, "reason": "tenants share a ledger", **fields}


def create(client: Any, key: str = "create-1", **fields: Any) -> Any:
    return post_json(client, POLICIES, create_body(**fields), key=key)


def create_ok(client: Any, key: str = "create-1", **fields: Any) -> dict[str, Any]:
    return assert_ok(create(client, key, **fields), 201)["policy"]


def configure(client: Any, policy_id: str, key: str = "configure-1", **fields: Any) -> Any:
    body = {"expected_revision": "1", "reason": "more room", "capacity": 2, **fields}
    return post_json(client, f"{POLICIES}/{policy_id}:configure", body, key=key)


def retire(client: Any, policy_id: str, revision: str = "1", key: str = "retire-1", **fields: Any) -> Any:
    body = {"expected_revision": revision, "reason": "done", **fields}
    return post_json(client, f"{POLICIES}/{policy_id}:retire", body, key=key)


def make_key_rows(namespace_id: str, keys: list[str]) -> None:
    """Key rows as their first leases would have left them, free (capacity 1, no rate)."""
    at = timezone.now() - timedelta(minutes=1)
    ConcurrencyKey.objects.bulk_create(
        [ConcurrencyKey(namespace_id=namespace_id, key=key, version=1, updated_at=at) for key in keys], batch_size=500
    )

"""Authentication, scopes and queue range on every queue endpoint (SPEC §2)."""

from __future__ import annotations

import pytest

from orbit.models import IdempotencyRecord
from orbit.tenancy import revoke_credential
from queues.models import Queue
from tests.conftest import api_client, post_json
from tests.support.api import assert_error, assert_ok
from tests.support.factories import NamespaceFactory, QueueFactory, make_credential
from tests.support.queues import SEED_CREATE, configure, configure_body, create_queue, get_queue, retire

ENDPOINTS = ["create", "get", "list", "configure", "retire"]


def call(client, endpoint: str, queue_id: str, key: str = "scoped-key"):
    if endpoint == "create":
        return post_json(client, "/v1/queues", {**SEED_CREATE, "name": "scoped"}, key=key)
    if endpoint == "get":
        return get_queue(client, queue_id)
    if endpoint == "list":
        return client.get("/v1/queues")
    if endpoint == "configure":
        return configure(client, queue_id, configure_body("1"), key=key)
    return retire(client, queue_id, {"expected_revision": "1", "reason": "r"}, key=key)


@pytest.fixture
def queue(tenant):
    return create_queue(tenant.client, "images", key="queue-images-v1")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Basic dXNlcjpwYXNz",
        "Bearer garbage",
        "Bearer orb_" + "0" * 32 + "_" + "s" * 43,
        "orb_" + "0" * 32 + "_" + "s" * 43,
    ],
    ids=["missing", "empty", "bearer-only", "bearer-blank", "basic", "garbage", "unknown-id", "no-scheme"],
)
def test_bad_or_missing_token_is_unauthenticated(tenant, queue, endpoint, authorization):
    client = api_client(None)
    if authorization is not None:
        client.credentials(HTTP_AUTHORIZATION=authorization)
    assert_error(call(client, endpoint, queue["id"]), 401, "UNAUTHENTICATED")
    assert Queue.objects.count() == 1


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_wrong_secret_for_a_real_credential_is_unauthenticated(tenant, queue, endpoint):
    prefix, credential_id, _secret = tenant.token.split("_", 2)
    client = api_client(f"{prefix}_{credential_id}_{'x' * 43}")
    assert_error(call(client, endpoint, queue["id"]), 401, "UNAUTHENTICATED")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_revoked_credential_is_unauthenticated(tenant, queue, endpoint):
    # given a credential that worked
    issued = make_credential(tenant.namespace)
    client = api_client(issued.token)
    assert_ok(get_queue(client, queue["id"]))
    # when it is revoked
    revoke_credential(issued.credential.id)
    # then every endpoint answers 401
    assert_error(call(client, endpoint, queue["id"]), 401, "UNAUTHENTICATED")


def test_revoked_credential_cannot_replay_its_own_create(tenant):
    issued = make_credential(tenant.namespace)
    client = api_client(issued.token)
    assert_ok(post_json(client, "/v1/queues", SEED_CREATE, key="queue-images-v1"), 201)
    revoke_credential(issued.credential.id)
    assert_error(post_json(client, "/v1/queues", SEED_CREATE, key="queue-images-v1"), 401, "UNAUTHENTICATED")


SCOPE_NEEDED = {
    "create": "queues:manage",
    "get": "queues:read",
    "list": "queues:read",
    "configure": "queues:manage",
    "retire": "queues:manage",
}
OTHER_SCOPES = ["tasks:submit", "tasks:read", "tasks:cancel", "workers:connect", "workers:consume"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_missing_scope_is_permission_denied(tenant, queue, endpoint):
    # given a credential with every scope but the one the endpoint needs
    everything_else = [
        scope for scope in ["queues:read", "queues:manage", *OTHER_SCOPES] if scope != SCOPE_NEEDED[endpoint]
    ]
    client = api_client(make_credential(tenant.namespace, scopes=everything_else).token)
    # when it calls the endpoint
    response = call(client, endpoint, queue["id"])
    # then 403 PERMISSION_DENIED naming the scope, and no effect
    assert SCOPE_NEEDED[endpoint] in assert_error(response, 403, "PERMISSION_DENIED")
    assert Queue.objects.count() == 1
    assert Queue.objects.get(id=queue["id"]).revision == 1
    assert not IdempotencyRecord.objects.filter(key="scoped-key").exists()


def test_manage_alone_does_not_grant_read(tenant, queue):
    client = api_client(make_credential(tenant.namespace, scopes=["queues:manage"]).token)
    assert_error(get_queue(client, queue["id"]), 403, "PERMISSION_DENIED")
    assert_ok(configure(client, queue["id"], configure_body("1"), key="cfg"))


def test_replay_rechecks_scope(tenant, queue):
    # given a configure accepted for a manage credential
    assert_ok(configure(tenant.client, queue["id"], configure_body("1"), key="cfg-1"))
    # when a read-only credential of the same namespace replays it
    reader = api_client(make_credential(tenant.namespace, scopes=["queues:read"]).token)
    # then it is refused, not handed the receipt
    assert_error(configure(reader, queue["id"], configure_body("1"), key="cfg-1"), 403, "PERMISSION_DENIED")
    assert_error(post_json(reader, "/v1/queues", SEED_CREATE, key="queue-images-v1"), 403, "PERMISSION_DENIED")


def test_queue_range_limits_single_resources_to_not_found(tenant, queue):
    # given two queues and a manager credential limited to the first
    other = create_queue(tenant.client, "videos", key="create-videos")
    limited = api_client(
        make_credential(tenant.namespace, scopes=["queues:read", "queues:manage"], queue_ids=[queue["id"]]).token
    )
    # then the covered queue can be read and configured
    assert_ok(get_queue(limited, queue["id"]))
    assert_ok(configure(limited, queue["id"], configure_body("1"), key="cfg-mine"))
    # and the other queue does not exist for it: read, configure, retire, replay
    assert_error(get_queue(limited, other["id"]), 404, "NOT_FOUND")
    assert_error(configure(limited, other["id"], configure_body("1"), key="cfg-other"), 404, "NOT_FOUND")
    assert_error(retire(limited, other["id"], {"expected_revision": "1", "reason": "r"}, key="ret"), 404, "NOT_FOUND")
    assert_ok(configure(tenant.client, other["id"], configure_body("1"), key="cfg-by-admin"))
    assert_error(configure(limited, other["id"], configure_body("1"), key="cfg-by-admin"), 404, "NOT_FOUND")
    # and the 404 looks the same as for a queue that does not exist at all
    missing = get_queue(limited, "0" * 32)
    assert assert_error(get_queue(limited, other["id"]), 404, "NOT_FOUND") == assert_error(missing, 404, "NOT_FOUND")
    assert Queue.objects.get(id=other["id"]).revision == 2
    assert not IdempotencyRecord.objects.filter(key__in=["cfg-other", "ret"]).exists()


def test_create_needs_the_all_queues_range(tenant, queue):
    # given a manager credential limited to one queue
    limited = api_client(
        make_credential(tenant.namespace, scopes=["queues:read", "queues:manage"], queue_ids=[queue["id"]]).token
    )
    # when it creates a queue, or replays the seed's create
    fresh = post_json(limited, "/v1/queues", {**SEED_CREATE, "name": "fresh"}, key="fresh")
    replay = post_json(limited, "/v1/queues", SEED_CREATE, key="queue-images-v1")
    # then 403 PERMISSION_DENIED
    assert_error(fresh, 403, "PERMISSION_DENIED")
    assert_error(replay, 403, "PERMISSION_DENIED")
    assert not Queue.objects.filter(name="fresh").exists()


def test_queue_of_another_namespace_is_not_found(tenant):
    # given a queue in another namespace of the same application, and one in another application
    sibling = NamespaceFactory(application=tenant.namespace.application)
    foreign = [QueueFactory(namespace=sibling), QueueFactory()]
    # and a credential whose list names those queues (it must not matter)
    listing = api_client(
        make_credential(
            tenant.namespace, scopes=["queues:read", "queues:manage"], queue_ids=[q.id for q in foreign]
        ).token
    )
    for client in (tenant.client, listing):
        for other in foreign:
            # then read, configure and retire all answer 404
            assert_error(get_queue(client, other.id), 404, "NOT_FOUND")
            assert_error(configure(client, other.id, configure_body("1"), key=f"c-{other.id}"), 404, "NOT_FOUND")
            assert_error(
                retire(client, other.id, {"expected_revision": "1", "reason": "r"}, key=f"r-{other.id}"),
                404,
                "NOT_FOUND",
            )
        # and the list shows none of them
        assert assert_ok(client.get("/v1/queues"))["items"] == []
    for other in foreign:
        other.refresh_from_db()
        assert other.revision == 1
    assert IdempotencyRecord.objects.count() == 0


def test_authentication_comes_before_validation(tenant):
    # An anonymous caller learns nothing about field rules.
    response = post_json(api_client(None), "/v1/queues", {"name": ""}, key="k")
    assert_error(response, 401, "UNAUTHENTICATED")
    response = post_json(api_client(None), "/v1/queues", "{not json", key=None)
    assert_error(response, 401, "UNAUTHENTICATED")

"""The key policy verbs over HTTP (SPEC §12): create, get, list, configure,
retire; every field rule a 400 naming the field; idempotency; revisions;
scopes; audit rows and events; the application's policy generation."""

from __future__ import annotations

import pytest

from orbit.models import Application, AuditEntry, Event, IdempotencyRecord
from tasks.models import KeyPolicy
from tests.conftest import api_client, post_json
from tests.support.api import HEX32, assert_error, assert_invalid, assert_ok, parse_time
from tests.support.factories import NamespaceFactory, make_credential
from tests.support.key_policies import POLICIES, configure, create, create_body, create_ok, retire

pytestmark = pytest.mark.django_db


def generation(tenant) -> int:
    return Application.objects.get(id=tenant.namespace.application_id).key_policy_generation


def test_create_answers_201_with_the_policy_and_defaults(tenant):
    # when a prefix policy is created with nothing but its match and reason
    data = assert_ok(create(tenant.client), 201)
    # then capacity 1, no rate, revision 1
    assert data["deduplicated"] is False
    policy = data["policy"]
    assert set(policy) == {"id", "namespace_id", "match", "capacity", "revision", "created_at", "updated_at"}
    assert HEX32.fullmatch(policy["id"]) and policy["namespace_id"] == tenant.namespace_id
    assert policy["match"] == {"prefix": "customer/"} and policy["capacity"] == 1 and policy["revision"] == "1"
    assert parse_time(policy["created_at"]) == parse_time(policy["updated_at"])


def test_a_rate_defaults_its_burst_to_one_and_answers_it(tenant):
    policy = create_ok(tenant.client, match={"key": "ledger"}, capacity=5, rate={"starts": 10, "per_seconds": 60})
    assert policy["match"] == {"key": "ledger"}
    assert policy["capacity"] == 5 and policy["rate"] == {"starts": 10, "per_seconds": 60, "burst": 1}
    row = KeyPolicy.objects.get(id=policy["id"])
    assert (row.rate_starts, row.rate_per_seconds, row.rate_burst, row.live) == (10, 60, 1, True)


def test_every_write_moves_the_application_generation_by_one(tenant):
    assert generation(tenant) == 0
    policy = create_ok(tenant.client)
    assert generation(tenant) == 1
    assert_ok(configure(tenant.client, policy["id"]))
    assert generation(tenant) == 2
    assert_ok(retire(tenant.client, policy["id"], revision="2"))
    assert generation(tenant) == 3
    # a rejected write moves nothing
    assert_error(retire(tenant.client, policy["id"], revision="3", key="retire-2"), 409, "STATE_CONFLICT")
    assert generation(tenant) == 3


def test_a_second_live_policy_with_the_same_match_is_a_state_conflict(tenant):
    create_ok(tenant.client)
    message = assert_error(create(tenant.client, key="create-2"), 409, "STATE_CONFLICT")
    assert "customer/" in message
    # the same text as a key is another match
    create_ok(tenant.client, key="create-3", match={"key": "customer/"})
    assert KeyPolicy.objects.count() == 2
    # a rejected request stores no idempotency record
    assert not IdempotencyRecord.objects.filter(key="create-2").exists()


def test_matches_compare_byte_for_byte(tenant):
    create_ok(tenant.client, match={"key": "Ledger"})
    create_ok(tenant.client, key="c2", match={"key": "ledger"})
    create_ok(tenant.client, key="c3", match={"key": "ledger\u00e9"})
    create_ok(tenant.client, key="c4", match={"key": "ledge\u0301r"})
    assert KeyPolicy.objects.count() == 4


def test_retire_then_create_again_with_the_same_match(tenant):
    first = create_ok(tenant.client)
    retired = assert_ok(retire(tenant.client, first["id"]))["policy"]
    assert retired["revision"] == "2" and parse_time(retired["retired_at"])
    second = create_ok(tenant.client, key="create-2", capacity=4)
    assert second["id"] != first["id"] and second["capacity"] == 4
    # the retired one still reads, with retired_at; the new one is live
    assert "retired_at" in assert_ok(tenant.client.get(f"{POLICIES}/{first['id']}"))
    assert "retired_at" not in assert_ok(tenant.client.get(f"{POLICIES}/{second['id']}"))
    row = KeyPolicy.objects.get(id=first["id"])
    assert row.live is None and row.retired_at is not None


def test_a_retired_policy_takes_no_configure_or_retire(tenant):
    policy = create_ok(tenant.client)
    assert_ok(retire(tenant.client, policy["id"]))
    assert assert_error(configure(tenant.client, policy["id"], expected_revision="2"), 409, "STATE_CONFLICT") == (
        "key policy is retired"
    )
    assert_error(retire(tenant.client, policy["id"], revision="2", key="retire-2"), 409, "STATE_CONFLICT")


def test_configure_is_a_full_replacement(tenant):
    policy = create_ok(tenant.client, capacity=3, rate={"starts": 5, "per_seconds": 10, "burst": 2})
    # when it is configured with a capacity and no rate
    after = assert_ok(configure(tenant.client, policy["id"], capacity=7))["policy"]
    # then the rate is gone, the match stays, the revision moved
    assert after["capacity"] == 7 and "rate" not in after and after["revision"] == "2"
    assert after["match"] == policy["match"] and after["created_at"] == policy["created_at"]
    assert parse_time(after["updated_at"]) >= parse_time(policy["updated_at"])
    again = configure(
        tenant.client, policy["id"], key="c2", expected_revision="2", rate={"starts": 1, "per_seconds": 1}
    )
    assert assert_ok(again)["policy"]["rate"] == {"starts": 1, "per_seconds": 1, "burst": 1}
    assert assert_ok(tenant.client.get(f"{POLICIES}/{policy['id']}"))["revision"] == "3"


def test_a_stale_revision_answers_as_a_queue_configure_does(tenant):
    policy = create_ok(tenant.client)
    assert_ok(configure(tenant.client, policy["id"]))
    message = assert_error(configure(tenant.client, policy["id"], key="c2"), 409, "STATE_CONFLICT")
    assert message == "expected_revision 1 does not match current revision 2"
    message = assert_error(retire(tenant.client, policy["id"], key="r2"), 409, "STATE_CONFLICT")
    assert message == "expected_revision 1 does not match current revision 2"
    assert KeyPolicy.objects.get(id=policy["id"]).capacity == 2


def test_idempotent_replay_and_mismatch(tenant):
    first = assert_ok(create(tenant.client, capacity=2), 201)
    # the same key and body: the original answer, 200, deduplicated
    replay = assert_ok(create(tenant.client, capacity=2), 200)
    assert replay["deduplicated"] is True and replay["policy"] == first["policy"]
    # the same key, another body
    assert_error(create(tenant.client, capacity=3), 409, "IDEMPOTENCY_CONFLICT")
    # the same key on another operation
    assert_error(configure(tenant.client, first["policy"]["id"], key="create-1"), 409, "IDEMPOTENCY_CONFLICT")
    assert KeyPolicy.objects.count() == 1 and AuditEntry.objects.count() == 1
    # configure and retire replay too
    changed = assert_ok(configure(tenant.client, first["policy"]["id"]))
    assert assert_ok(configure(tenant.client, first["policy"]["id"]))["deduplicated"] is True
    retired = assert_ok(retire(tenant.client, first["policy"]["id"], revision="2"))
    replayed = assert_ok(retire(tenant.client, first["policy"]["id"], revision="2"))
    assert replayed == {**retired, "deduplicated": True} and changed["policy"]["revision"] == "2"


def test_the_idempotency_key_is_required(tenant):
    assert_invalid(post_json(tenant.client, POLICIES, create_body()), "Idempotency-Key")


def test_writes_are_audited_and_evented(tenant):
    policy = create_ok(tenant.client)
    assert_ok(configure(tenant.client, policy["id"], reason="two at once"))
    assert_ok(retire(tenant.client, policy["id"], revision="2", reason="moved"))
    entries = list(AuditEntry.objects.filter(target_id=policy["id"]).order_by("id"))
    assert [(e.action, e.target_type, e.reason) for e in entries] == [
        ("key_policy.created", "key_policy", "tenants share a ledger"),
        ("key_policy.configured", "key_policy", "two at once"),
        ("key_policy.retired", "key_policy", "moved"),
    ]
    assert entries[0].before is None and entries[0].after["revision"] == "1"
    assert entries[1].before["capacity"] == 1 and entries[1].after["capacity"] == 2
    assert "retired_at" in entries[2].after and "retired_at" not in entries[2].before
    events = list(Event.objects.filter(subject_id=policy["id"]).order_by("seq"))
    assert [e.type for e in events] == ["key_policy.created", "key_policy.configured", "key_policy.retired"]
    assert events[1].data["after"]["capacity"] == 2 and events[1].data["reason"] == "two at once"
    assert {e.request_id for e in entries} == {e.data["request_id"] for e in events}


def test_get_and_list(tenant):
    ids = [create_ok(tenant.client, key=f"c-{n}", match={"key": f"k/{n}"})["id"] for n in range(5)]
    assert_ok(retire(tenant.client, ids[2]))
    # the list: every policy, retired too, in id order, a page at a time
    first = assert_ok(tenant.client.get(f"{POLICIES}?page_size=3"))
    assert [p["id"] for p in first["items"]] == sorted(ids)[:3] and first["next_page_token"]
    rest = assert_ok(tenant.client.get(f"{POLICIES}?page_size=3&page_token={first['next_page_token']}"))
    assert [p["id"] for p in rest["items"]] == sorted(ids)[3:] and rest["next_page_token"] == ""
    listed = {p["id"]: p for p in first["items"] + rest["items"]}
    assert "retired_at" in listed[ids[2]] and "retired_at" not in listed[ids[0]]
    assert assert_ok(tenant.client.get(f"{POLICIES}/{ids[0]}")) == listed[ids[0]]
    assert_invalid(tenant.client.get(f"{POLICIES}?page_size=0"), "page_size")
    assert_invalid(tenant.client.get(f"{POLICIES}?page_token=%21%21"), "page_token")


def test_another_namespace_sees_nothing(tenant):
    policy = create_ok(tenant.client)
    other = api_client(make_credential(NamespaceFactory()).token)
    assert_error(other.get(f"{POLICIES}/{policy['id']}"), 404, "NOT_FOUND")
    assert assert_ok(other.get(POLICIES))["items"] == []
    assert_error(configure(other, policy["id"]), 404, "NOT_FOUND")
    assert_error(retire(other, policy["id"]), 404, "NOT_FOUND")
    assert_error(tenant.client.get(f"{POLICIES}/not-an-id"), 404, "NOT_FOUND")
    assert_error(configure(tenant.client, "0" * 32), 404, "NOT_FOUND")


def test_scopes(tenant):
    policy = create_ok(tenant.client)
    reader_scopes = ["tasks:read", "tasks:submit", "queues:manage", "queues:read"]
    # without keys:manage: no write, whatever else it holds
    reader = api_client(make_credential(tenant.namespace, scopes=reader_scopes).token)
    assert "keys:manage" in assert_error(create(reader, key="x"), 403, "PERMISSION_DENIED")
    assert_error(configure(reader, policy["id"]), 403, "PERMISSION_DENIED")
    assert_error(retire(reader, policy["id"]), 403, "PERMISSION_DENIED")
    # reads: tasks:read over all queues
    assert assert_ok(reader.get(f"{POLICIES}/{policy['id']}"))["id"] == policy["id"]
    assert len(assert_ok(reader.get(POLICIES))["items"]) == 1
    # tasks:read over some queues only: not enough
    queue_id = assert_ok(
        post_json(tenant.client, "/v1/queues", {"name": "q", "max_concurrency": 1, "rate_per_second": 1}, key="q"), 201
    )["queue"]["id"]
    ranged = api_client(make_credential(tenant.namespace, scopes=["tasks:read"], queue_ids=[queue_id]).token)
    assert_error(ranged.get(POLICIES), 403, "PERMISSION_DENIED")
    assert_error(ranged.get(f"{POLICIES}/{policy['id']}"), 403, "PERMISSION_DENIED")
    # neither scope
    nothing = api_client(make_credential(tenant.namespace, scopes=["queues:read"]).token)
    assert_error(nothing.get(POLICIES), 403, "PERMISSION_DENIED")
    # keys:manage alone reads and writes over all queues, and neither over a queue range:
    # a policy governs keys that every queue's tasks hold
    manager = api_client(make_credential(tenant.namespace, scopes=["keys:manage"]).token)
    assert len(assert_ok(manager.get(POLICIES))["items"]) == 1
    create_ok(manager, key="m-1", match={"key": "solo"})
    narrowed = api_client(make_credential(tenant.namespace, scopes=["keys:manage"], queue_ids=[queue_id]).token)
    range_refused = "credential's queue range does not cover all queues of the namespace"
    assert assert_error(narrowed.get(POLICIES), 403, "PERMISSION_DENIED") == range_refused
    assert assert_error(narrowed.get(f"{POLICIES}/{policy['id']}"), 403, "PERMISSION_DENIED") == range_refused
    assert assert_error(create(narrowed, key="m-2"), 403, "PERMISSION_DENIED") == range_refused
    assert assert_error(configure(narrowed, policy["id"]), 403, "PERMISSION_DENIED") == range_refused
    assert assert_error(retire(narrowed, policy["id"]), 403, "PERMISSION_DENIED") == range_refused
    assert assert_ok(tenant.client.get(f"{POLICIES}/{policy['id']}"))["revision"] == policy["revision"]
    # no credential
    assert_error(api_client(None).get(POLICIES), 401, "UNAUTHENTICATED")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "match"),
        ({"match": None}, "match"),
        ({"match": "customer/"}, "match"),
        ({"match": {}}, "match"),
        ({"match": {"key": "a", "prefix": "b"}}, "match"),
        ({"match": {"key": ""}}, "match.key"),
        ({"match": {"prefix": ""}}, "match.prefix"),
        ({"match": {"key": "x" * 192}}, "match.key"),
        ({"match": {"prefix": "a\u0000b"}}, "match.prefix"),
        ({"match": {"prefix": "a\nb"}}, "match.prefix"),
        ({"match": {"key": "a\u0085"}}, "match.key"),
        ({"match": {"key": " a"}}, "match.key"),
        ({"match": {"prefix": "a "}}, "match.prefix"),
        ({"match": {"key": 7}}, "match.key"),
        ({"match": {"key": "\ud800"}}, "match.key"),
        ({"match": {"name": "a"}}, "match.name"),
        ({"capacity": 0}, "capacity"),
        ({"capacity": 1001}, "capacity"),
        ({"capacity": "2"}, "capacity"),
        ({"capacity": 2.0}, "capacity"),
        ({"capacity": True}, "capacity"),
        ({"capacity": None}, "capacity"),
        ({"rate": None}, "rate"),
        ({"rate": []}, "rate"),
        ({"rate": {"per_seconds": 1}}, "rate.starts"),
        ({"rate": {"starts": 1}}, "rate.per_seconds"),
        ({"rate": {"starts": 0, "per_seconds": 1}}, "rate.starts"),
        ({"rate": {"starts": 100_001, "per_seconds": 1}}, "rate.starts"),
        ({"rate": {"starts": 1, "per_seconds": 0}}, "rate.per_seconds"),
        ({"rate": {"starts": 1, "per_seconds": 3601}}, "rate.per_seconds"),
        ({"rate": {"starts": 1, "per_seconds": 1, "burst": 0}}, "rate.burst"),
        ({"rate": {"starts": 1, "per_seconds": 1, "burst": 100_001}}, "rate.burst"),
        ({"rate": {"starts": 1, "per_seconds": 1, "every": 2}}, "rate.every"),
        ({"reason": ""}, "reason"),
        ({"reason": "   "}, "reason"),
        ({"reason": None}, "reason"),
        ({"reason": "x" * 1025}, "reason"),
        ({"paused": False}, "paused"),
    ],
)
def test_every_bad_create_field_is_a_400_naming_it(tenant, body, field):
    full = {**create_body(), **body}
    if "reason" in body and body["reason"] is None:
        full["reason"] = None
    if body == {}:
        del full["match"]
    assert_invalid(post_json(tenant.client, POLICIES, full, key="bad"), field)
    assert not KeyPolicy.objects.exists() and not IdempotencyRecord.objects.exists()


def test_the_limits_themselves_are_accepted(tenant):
    rate = {"starts": 100_000, "per_seconds": 3600, "burst": 100_000}
    create_ok(tenant.client, match={"key": "x" * 191}, capacity=1000, rate=rate)
    create_ok(tenant.client, key="c2", match={"prefix": "é/\u4e2d"}, capacity=1, rate={"starts": 1, "per_seconds": 1})


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"expected_revision": None}, "expected_revision"),
        ({"expected_revision": 1}, "expected_revision"),
        ({"expected_revision": "0"}, "expected_revision"),
        ({"expected_revision": "01"}, "expected_revision"),
        ({"reason": ""}, "reason"),
        ({"capacity": 0}, "capacity"),
        ({"capacity": None}, "capacity"),
        ({"rate": {"starts": 1, "per_seconds": 4000}}, "rate.per_seconds"),
        ({"match": {"key": "other"}}, "match"),
        ({"paused": True}, "paused"),
    ],
)
def test_every_bad_configure_field_is_a_400_naming_it(tenant, body, field):
    policy = create_ok(tenant.client)
    full = {"expected_revision": "1", "reason": "r", "capacity": 2, **body}
    assert_invalid(post_json(tenant.client, f"{POLICIES}/{policy['id']}:configure", full, key="bad"), field)


def test_configure_needs_the_capacity_and_retire_its_fields(tenant):
    policy = create_ok(tenant.client)
    body = {"expected_revision": "1", "reason": "r"}
    assert_invalid(post_json(tenant.client, f"{POLICIES}/{policy['id']}:configure", body, key="c"), "capacity")
    assert_invalid(
        post_json(tenant.client, f"{POLICIES}/{policy['id']}:retire", {"reason": "r"}, key="r"), "expected_revision"
    )
    assert_invalid(
        post_json(tenant.client, f"{POLICIES}/{policy['id']}:retire", {"expected_revision": "1"}, key="r2"), "reason"
    )
    assert_invalid(retire(tenant.client, policy["id"], capacity=1), "capacity")
    assert_invalid(post_json(tenant.client, POLICIES, [1], key="list"), "request body")
    assert_invalid(post_json(tenant.client, POLICIES, b"{", key="broken"), "request body")

"""Concurrent key policy writes against the database: one live policy per
match, one effect per Idempotency-Key (SPEC §3, §12)."""

from __future__ import annotations

from collections import Counter

import pytest

from orbit.models import Application, AuditEntry, IdempotencyRecord
from tasks.models import KeyPolicy
from tests.conftest import api_client, post_json
from tests.support.key_policies import POLICIES, configure, create_body, create_ok
from tests.support.race import race

pytestmark = [pytest.mark.mysql_only, pytest.mark.django_db(transaction=True)]


def test_concurrent_creates_of_one_match_make_exactly_one_policy(tenant):
    # given 12 callers creating the same match, each under its own key
    def send(index: int) -> tuple[int, dict]:
        response = post_json(api_client(tenant.token), POLICIES, create_body(capacity=index + 1), key=f"c-{index}")
        return response.status_code, response.json()

    # when they all send at once
    results = race(12, send)
    # then exactly one 201; the others 409 STATE_CONFLICT, with nothing stored
    statuses = Counter(status for status, _ in results)
    assert statuses == {201: 1, 409: 11}, results
    assert {body["error"]["code"] for status, body in results if status == 409} == {"STATE_CONFLICT"}
    (winner,) = [body["data"]["policy"] for status, body in results if status == 201]
    assert list(KeyPolicy.objects.values_list("id", flat=True)) == [winner["id"]]
    assert IdempotencyRecord.objects.count() == 1 and AuditEntry.objects.count() == 1
    assert Application.objects.get(id=tenant.namespace.application_id).key_policy_generation == 1


def test_the_unique_constraint_catches_creates_the_existence_check_missed(tenant, monkeypatch):
    # given creates whose lock-free existence check always finds nothing
    from tasks.actions import policies

    real_filter = KeyPolicy.objects.filter

    class Blind:
        def exists(self) -> bool:
            return False

    def filter_blind(*args, **kwargs):
        return Blind() if kwargs.get("live") is True and "match_value" in kwargs else real_filter(*args, **kwargs)

    monkeypatch.setattr(policies.KeyPolicy.objects, "filter", filter_blind)

    def send(index: int) -> int:
        return post_json(api_client(tenant.token), POLICIES, create_body(), key=f"b-{index}").status_code

    # then the index alone keeps it to one live policy, and the losers get 409, not 500
    assert Counter(race(8, send)) == {201: 1, 409: 7}
    assert KeyPolicy.objects.count() == 1


def test_concurrent_duplicates_of_one_create_have_one_effect(tenant):
    def send(_: int) -> tuple[int, dict]:
        response = post_json(api_client(tenant.token), POLICIES, create_body(), key="same")
        return response.status_code, response.json()

    results = race(10, send)
    assert Counter(status for status, _ in results) == {201: 1, 200: 9}
    assert len({body["data"]["policy"]["id"] for _, body in results}) == 1
    assert KeyPolicy.objects.count() == 1 and AuditEntry.objects.count() == 1


def test_concurrent_configures_at_one_revision_have_one_winner(tenant):
    policy = create_ok(tenant.client)

    def send(index: int) -> int:
        return configure(api_client(tenant.token), policy["id"], key=f"cfg-{index}", capacity=index + 2).status_code

    assert Counter(race(8, send)) == {200: 1, 409: 7}
    row = KeyPolicy.objects.get(id=policy["id"])
    assert row.revision == 2 and row.applied_revision == 2
    assert Application.objects.get(id=tenant.namespace.application_id).key_policy_generation == 2

"""The console's key policy page: read only, with the match, capacity, rate,
revision and state of every policy, retired ones too."""

from __future__ import annotations

import pytest

from tests.support.api import assert_ok
from tests.support.key_policies import create_ok, retire

pytestmark = pytest.mark.django_db


def test_the_list_shows_each_policy_and_refuses_changes(operator, tenant):
    rated = create_ok(tenant.client, capacity=5, rate={"starts": 10, "per_seconds": 60, "burst": 3})
    gone = create_ok(tenant.client, key="c2", match={"key": "ledger/1"})
    assert_ok(retire(tenant.client, gone["id"]))
    page = operator.get("/admin/tasks/keypolicy/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "prefix customer/" in text and "key ledger/1" in text
    assert "10 per 60 s, burst 3" in text and "retired 20" in text and ">live<" in text
    change = operator.get(f"/admin/tasks/keypolicy/{rated['id']}/change/")
    assert change.status_code == 200 and 'name="_save"' not in change.content.decode()
    assert operator.get("/admin/tasks/keypolicy/add/").status_code == 403
    assert operator.post(f"/admin/tasks/keypolicy/{rated['id']}/delete/", {"post": "yes"}).status_code == 403

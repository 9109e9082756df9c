"""GET /metrics: orbit_key_permits_in_use, the valid key permits held per key policy (its id,
or "default" for keys no policy matches), summed from the key rows at scrape time."""

from __future__ import annotations

import re

import pytest

from tasks.models import KeyPolicy
from tests.conftest import api_client
from tests.support.api import make_queue
from tests.support.key_rows import make_policy
from tests.support.tasks import lease_one, report, start, submit_ok

TOKEN = "operator-scrape-token-0123456789"
METRIC = "orbit_key_permits_in_use"

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def metrics_on(settings):
    settings.ORBIT_METRICS_TOKEN = TOKEN


def permits(tenant) -> dict[str, float]:
    """This tenant's samples by policy label."""
    response = api_client(TOKEN).get("/metrics")
    assert response.status_code == 200
    namespace = tenant.namespace
    found = {}
    for line in response.content.decode().splitlines():
        match = re.fullmatch(rf"{METRIC}\{{(.*)\}} (\S+)", line)
        if match:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match[1]))
            assert set(labels) == {"application", "environment", "namespace", "policy"}
            if (labels["application"], labels["environment"], labels["namespace"]) == (
                namespace.application.name,
                namespace.environment,
                namespace.name,
            ):
                found[labels["policy"]] = float(match[2])
    return found


def test_permits_in_use_per_policy_and_default(tenant):
    wide = make_policy(tenant.namespace, prefix="printer/", capacity=3)
    idle = make_policy(tenant.namespace, key="never-used", capacity=2)
    queue = make_queue(tenant.client, max_concurrency=20)
    for key, count in (("printer/1", 3), ("printer/2", 2), ("plain-1", 1), ("plain-2", 1)):
        for n in range(count):
            submit_ok(tenant.client, queue["id"], f"{key}-{n}", concurrency_key=key)
    assert permits(tenant) == {wide.id: 0, idle.id: 0}  # every live policy, 0 while nothing holds
    leases = [lease_one(tenant, queue["id"]) for _ in range(7)]
    assert permits(tenant) == {wide.id: 5, idle.id: 0, "default": 2}
    # a finished holder gives its permit back; a retired policy's keys fall back to the default
    finished = next(lease for lease in leases if lease["task"]["concurrency_key"] == "plain-1")
    start(finished)
    report(finished, "SUCCEEDED")
    assert permits(tenant) == {wide.id: 5, idle.id: 0, "default": 1}
    KeyPolicy.objects.filter(id=wide.id).update(live=None)
    moved = make_policy(tenant.namespace, key="moves-the-generation")
    assert permits(tenant) == {idle.id: 0, moved.id: 0, "default": 6}

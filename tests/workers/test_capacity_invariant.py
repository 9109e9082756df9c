"""orbit_check holds every worker session to the capacity its hello declared."""

from __future__ import annotations

import pytest

from tasks.invariants import find_violations
from tasks.models import WorkerIdentity
from tests.support.api import make_queue
from tests.support.tasks import (
    connect_fixture,  # noqa: F401 - fixture "connect"
    submit_ok,
)

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_session_holding_more_than_its_capacity_is_reported(tenant, connect):
    queue = make_queue(tenant.client, "capacity-check", max_concurrency=10)
    for n in range(2):
        submit_ok(tenant.client, queue["id"], f"capacity-{n}")
    worker = connect()
    worker.hello_as([queue["id"]], capacity=2, worker_id="w-capacity")
    worker.assignments(2)
    identity = WorkerIdentity.objects.get(worker_id="w-capacity")
    assert identity.capacity == 2
    assert find_violations() == []
    # as if a path had given this session one attempt more than it asked for
    WorkerIdentity.objects.filter(pk=identity.pk).update(capacity=1)
    assert find_violations() == [f"worker 'w-capacity' session {identity.session_id}: 2 active attempts, capacity 1"]
    WorkerIdentity.objects.filter(pk=identity.pk).update(capacity=2)

"""GET /metrics per-queue gauges equal what the rows say (every state,
after tasks finish, after a queue is retired), and the exposition stays valid
(prometheus_client's parser) with names holding quotes, backslashes, newlines
and unicode."""

from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orbit.models import Application, Namespace
from queues.models import Queue
from tasks.models import Attempt, Task
from tests.conftest import api_client, post_json
from tests.support.api import assert_ok, make_queue
from tests.support.tasks import (
    cancel,
    configure_queue,
    ends_unknown,
    get_queue,
    lease_one,
    report,
    resolve,
    start,
    submit_ok,
)

TOKEN = "operator-scrape-token-0123456789"
STATES = ("BLOCKED", "WAITING", "LEASED", "RUNNING", "NEEDS_REVIEW")
UNFINISHED = list(STATES)


def scrape() -> dict:
    response = api_client(TOKEN).get("/metrics")
    assert response.status_code == 200
    text = response.content.decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    seen = Counter()
    per_queue: dict[tuple, dict[str, float]] = {}
    for family in families.values():
        for sample in family.samples:
            labels = dict(sample.labels)
            seen[(sample.name, tuple(sorted(labels.items())))] += 1
            if sample.name == "orbit_queue_tasks":
                key = (labels["application"], labels["environment"], labels["namespace"], labels["queue"])
                per_queue.setdefault(key, {})[labels["state"]] = sample.value
            elif sample.name.startswith("orbit_queue_"):
                key = (labels["application"], labels["environment"], labels["namespace"], labels["queue"])
                per_queue.setdefault(key, {})[sample.name] = sample.value
    duplicates = [key for key, count in seen.items() if count > 1]
    assert duplicates == [], duplicates
    return per_queue


def key_permits(namespace_id: str) -> dict[str, float]:
    """orbit_key_permits_in_use of this namespace, by policy label."""
    namespace = Namespace.objects.get(id=namespace_id)
    response = api_client(TOKEN).get("/metrics")
    found = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            if sample.name == "orbit_key_permits_in_use" and sample.labels["namespace"] == namespace.name:
                found[sample.labels["policy"]] = sample.value
    return found


def from_rows(queue_id: str) -> dict[str, float]:
    by_state = Counter(Task.objects.filter(queue_id=queue_id, state__in=UNFINISHED).values_list("state", flat=True))
    active = Attempt.objects.filter(queue_id=queue_id, state__in=["LEASED", "RUNNING"]).count()
    expected = {state: float(by_state.get(state, 0)) for state in STATES}
    expected["orbit_queue_unfinished_tasks"] = float(sum(by_state.values()))
    expected["orbit_queue_active_permits"] = float(active)
    return expected


def labels_of(queue_id: str) -> tuple[str, str, str, str]:
    queue = Queue.objects.get(id=queue_id)
    namespace = Namespace.objects.get(id=queue.namespace_id)
    application = Application.objects.get(id=namespace.application_id)
    return (application.name, namespace.environment, namespace.name, queue.name)


def assert_gauges_match(queue_id: str) -> None:
    got = scrape()[labels_of(queue_id)]
    expected = from_rows(queue_id)
    assert {k: got.get(k) for k in expected} == expected


@pytest.mark.django_db
def test_gauges_equal_the_rows_through_finish_rename_and_retire(settings, tenant):
    settings.ORBIT_METRICS_TOKEN = TOKEN
    client = tenant.client
    queue = make_queue(client, max_concurrency=50, rate_per_second=100_000)
    q = queue["id"]
    submit_ok(client, q, "r1")
    review_lease = ends_unknown(tenant, q)
    submit_ok(client, q, "s1")
    lease = lease_one(tenant, q)
    start(lease)
    report(lease, "SUCCEEDED")
    run1 = submit_ok(client, q, "run1", concurrency_key="printer")
    running = lease_one(tenant, q)
    start(running)
    submit_ok(client, q, "l1")
    leased = lease_one(tenant, q)
    blocked = submit_ok(client, q, "b1", depends_on=[run1["id"]])
    waiting = [submit_ok(client, q, f"w{i}") for i in range(2)]
    expected = from_rows(q)
    assert expected["BLOCKED"] == 1 and expected["WAITING"] == 2 and expected["LEASED"] == 1
    assert expected["RUNNING"] == 1 and expected["NEEDS_REVIEW"] == 1
    assert_gauges_match(q)
    assert key_permits(tenant.namespace_id) == {"default": 1.0}

    # Names holding quotes, backslashes, newlines and unicode (set on the rows).
    namespace = Namespace.objects.get(id=tenant.namespace_id)
    Queue.objects.filter(id=q).update(name='q"uo\\te\nnl \u00fc\u2713 \U0001f680')
    Namespace.objects.filter(id=namespace.id).update(name='ns"\\\n\u00e9', environment='env\\n"x"')
    Application.objects.filter(id=namespace.application_id).update(name='app \u65e5\u672c \\"\n')
    assert_gauges_match(q)
    assert key_permits(tenant.namespace_id) == {"default": 1.0}

    # Tasks finish: the dependency ends, the blocked one waits, the leased one runs and fails.
    report(running, "SUCCEEDED")
    assert Task.objects.get(id=blocked["id"]).state == "WAITING"
    start(leased)
    report(leased, "FAILED", error={"code": "x"})
    assert_gauges_match(q)
    assert key_permits(tenant.namespace_id) == {"default": 0.0} or key_permits(tenant.namespace_id) == {}

    # Every unfinished task ends: all gauges 0; then the queue is retired and left out.
    for task in [blocked, *waiting]:
        assert cancel(client, task["id"], f"c-{task['id']}").status_code == 200
    review_task = Attempt.objects.get(id=review_lease["attempt_id"]).task_id
    assert_ok(resolve(client, review_task, "res"))
    assert Task.objects.filter(queue_id=q, state__in=UNFINISHED).count() == 0
    assert_gauges_match(q)
    configure_queue(client, q, paused=True)
    revision = get_queue(client, q)["revision"]
    assert_ok(post_json(client, f"/v1/queues/{q}:retire", {"expected_revision": revision, "reason": "done"}, key="rt"))
    assert labels_of(q) not in scrape()

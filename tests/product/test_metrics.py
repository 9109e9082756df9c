"""GET /metrics: the platform operator's (ORBIT_METRICS_TOKEN), with per-queue
gauges read from queue_state rows, never from a scan of the task table."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from orbit.models import Namespace
from orbit.tenancy import revoke_credential
from tests.conftest import api_client
from tests.support.api import assert_error, make_queue
from tests.support.factories import NamespaceFactory, QueueFactory, make_credential
from tests.support.tasks import lease_one, report, start, submit_ok

TOKEN = "operator-scrape-token-0123456789"

pytestmark = pytest.mark.django_db


@pytest.fixture
def metrics_on(settings):
    settings.ORBIT_METRICS_TOKEN = TOKEN


def scrape(token: str | None = TOKEN):
    return api_client(token).get("/metrics")


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of one metric, keyed by their sorted labels."""
    found = {}
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match:
            labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match[1])))
            found[labels] = float(match[2])
    return found


def queue_labels(tenant, queue_name: str, **extra: str) -> tuple[tuple[str, str], ...]:
    namespace = tenant.namespace
    labels = {
        "application": namespace.application.name,
        "environment": namespace.environment,
        "namespace": namespace.name,
        "queue": queue_name,
        **extra,
    }
    return tuple(sorted(labels.items()))


def test_metrics_are_off_without_the_variable(settings, tenant):
    settings.ORBIT_METRICS_TOKEN = None
    for token in (None, tenant.token, TOKEN):
        assert_error(scrape(token), 404, "NOT_FOUND")


def test_the_operator_token_reads_them(metrics_on):
    response = scrape()
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    assert "orbit_tasks_submitted_total" in response.content.decode()


def test_a_tenant_credential_is_refused_with_403(metrics_on, tenant):
    assert_error(scrape(tenant.token), 403, "PERMISSION_DENIED")
    assert "ORBIT_METRICS_TOKEN" in scrape(tenant.token).json()["error"]["message"]


def test_no_token_or_a_wrong_one_is_401(metrics_on, tenant):
    assert_error(scrape(None), 401, "UNAUTHENTICATED")
    assert_error(scrape(TOKEN + "x"), 401, "UNAUTHENTICATED")
    assert_error(scrape(TOKEN[:-1]), 401, "UNAUTHENTICATED")
    # A well-formed credential token that is not a live credential is just a wrong token.
    unknown = "orb_" + "0" * 32 + "_" + "A" * 43
    assert_error(scrape(unknown), 401, "UNAUTHENTICATED")
    revoked = make_credential(tenant.namespace)
    revoke_credential(revoked.credential.id)
    assert_error(scrape(revoked.token), 401, "UNAUTHENTICATED")
    assert_error(api_client(None).get("/metrics", HTTP_AUTHORIZATION=f"Basic {TOKEN}"), 401, "UNAUTHENTICATED")


def test_per_queue_gauges_by_state_permits_and_start_window(metrics_on, tenant):
    queue = make_queue(tenant.client, "gauged")
    for n in range(5):
        submit_ok(tenant.client, queue["id"], f"g-{n}")
    lease_one(tenant, queue["id"], worker_id="w-leased")  # stays LEASED
    running = lease_one(tenant, queue["id"], worker_id="w-running")
    start(running)
    doubtful = lease_one(tenant, queue["id"], worker_id="w-doubt")
    start(doubtful)
    assert report(doubtful, "UNKNOWN", error={"code": "timeout"})["task_state"] == "NEEDS_REVIEW"
    # Another tenant's idle queue is a series of its own.
    other = QueueFactory(namespace=NamespaceFactory(), name="gauged")

    text = scrape().content.decode()
    tasks = samples(text, "orbit_queue_tasks")
    assert tasks[queue_labels(tenant, "gauged", state="WAITING")] == 2
    assert tasks[queue_labels(tenant, "gauged", state="LEASED")] == 1
    assert tasks[queue_labels(tenant, "gauged", state="RUNNING")] == 1
    assert tasks[queue_labels(tenant, "gauged", state="NEEDS_REVIEW")] == 1
    labels = queue_labels(tenant, "gauged")
    assert samples(text, "orbit_queue_unfinished_tasks")[labels] == 5
    assert samples(text, "orbit_queue_active_permits")[labels] == 2
    assert samples(text, "orbit_queue_start_window_count")[labels] == 2  # two starts, within the second
    assert samples(text, "orbit_queue_max_concurrency")[labels] == queue["max_concurrency"]
    assert samples(text, "orbit_queue_rate_per_second")[labels] == queue["rate_per_second"]
    assert samples(text, "orbit_queue_paused")[labels] == 0
    other_namespace = Namespace.objects.get(id=other.namespace_id)
    other_labels = (
        ("application", other_namespace.application.name),
        ("environment", other_namespace.environment),
        ("namespace", other_namespace.name),
        ("queue", "gauged"),
    )
    assert samples(text, "orbit_queue_unfinished_tasks")[other_labels] == 0
    assert samples(text, "orbit_queue_tasks")[(*other_labels[:3], ("queue", "gauged"), ("state", "WAITING"))] == 0


def test_a_scrape_reads_queue_state_rows_and_no_task_scan(metrics_on, tenant):
    queue = make_queue(tenant.client, "counted")
    submit_ok(tenant.client, queue["id"], "c-1")
    with CaptureQueriesContext(connection) as queries:
        assert scrape().status_code == 200
    task_reads = [q["sql"] for q in queries if "orbit_task" in q["sql"] and "orbit_task_" not in q["sql"]]
    # Only the NEEDS_REVIEW count touches the task table, by queue id and
    # state: ranges of the dispatch index (queue_id, state, ...).
    assert len(task_reads) == 1, task_reads
    assert "NEEDS_REVIEW" in task_reads[0] and "queue_id" in task_reads[0] and " IN (" in task_reads[0]
    if connection.vendor == "mysql":
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN " + task_reads[0])
            columns = [c[0] for c in cursor.description]
            plan = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
        # "ref" for one queue id, "range" for several: never "ALL" (a scan)
        assert plan[0]["key"] == "idx_task_dispatch" and plan[0]["type"] in ("ref", "range"), plan
        assert "Using index" in (plan[0]["Extra"] or ""), plan

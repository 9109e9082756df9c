"""Black box against a live server: every route under every
HTTP method, the probes, and /metrics."""

from __future__ import annotations

import uuid

import pytest
import requests

from orbit.tenancy import revoke_credential
from tests.support.api import make_queue
from tests.support.key_policies import create_ok
from tests.support.live import LIVE_METRICS_TOKEN
from tests.support.tasks import submit_ok

pytestmark = pytest.mark.django_db(transaction=True)

ODD_METHODS = ("PUT", "PATCH", "DELETE", "TRACE", "PROPFIND")


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
def test_the_probes_refuse_other_methods_with_405(orbit_server, path, method):
    """SPEC §11 names GET /healthz and GET /readyz; every other route answers a
    wrong method 405 (docs/decisions.md "405"). The probes answer 200 to any."""
    answer = requests.request(method, orbit_server.url + path, timeout=10)
    assert answer.status_code == 405, (method, path, answer.status_code, answer.text[:200])


def test_no_route_answers_500_to_any_method(tenant, orbit_server):
    """Every route, with and without a credential, under methods it does not
    take: 401/403/404/405 (the console's CSRF 403 and login redirect), never
    500, never a success for a method that would write."""
    queue = make_queue(tenant.client, "methods")
    task = submit_ok(tenant.client, queue["id"], "methods-1")
    policy = create_ok(tenant.client, key="methods-policy", match={"prefix": "m/"}, capacity=2)
    unknown = uuid.uuid4().hex
    paths = [
        "/metrics",
        "/v1/openapi.json",
        f"/v1/applications/{tenant.namespace.application_id}",
        f"/v1/applications/{tenant.namespace.application_id}:configure",
        "/v1/events",
        "/v1/concurrency-keys",
        "/v1/concurrency-keys/a%2Fb",
        "/v1/queues",
        f"/v1/queues/{queue['id']}",
        f"/v1/queues/{queue['id']}:configure",
        f"/v1/queues/{queue['id']}:retire",
        "/v1/tasks",
        "/v1/tasks:batch",
        f"/v1/tasks/{task['id']}",
        f"/v1/tasks/{task['id']}:cancel",
        f"/v1/tasks/{task['id']}:resolve",
        f"/v1/tasks/{task['id']}/attempts",
        f"/v1/tasks/{task['id']}/blockers",
        f"/v1/tasks/{task['id']}/dependencies",
        f"/v1/tasks/{task['id']}/dependents",
        "/v1/key-policies",
        f"/v1/key-policies/{policy['id']}",
        f"/v1/key-policies/{policy['id']}:configure",
        f"/v1/key-policies/{policy['id']}:retire",
        f"/v1/attempts/{unknown}",
        "/v1/plans",
        f"/v1/plans/{unknown}",
        f"/v1/plans/{unknown}:update",
        f"/v1/plans/{unknown}:pause",
        f"/v1/plans/{unknown}/triggers",
        "/v1/workers/connect",
        "/admin/",
        "/admin/login/",
        f"/admin/tasks/task/{task['id']}/change/",
        "/static/admin/css/base.css",
        "/v1/../admin/",
        "/v1/tasks/..%2F..%2Fadmin",
    ]
    bearer = {"Authorization": f"Bearer {tenant.token}"}
    wrong = []
    with requests.Session() as session:
        for path in paths:
            for method in ("GET", "HEAD", "OPTIONS", "POST", *ODD_METHODS):
                for headers in (bearer, {}):
                    answer = session.request(
                        method, orbit_server.url + path, headers=headers, allow_redirects=False, timeout=10
                    )
                    allowed = (302, 401, 403, 404, 405) if method in ODD_METHODS else range(200, 500)
                    if answer.status_code not in allowed:
                        wrong.append((method, path, bool(headers), answer.status_code, answer.text[:120]))
    assert wrong == []


def test_metrics_belongs_to_the_operator(tenant, orbit_server):
    url = orbit_server.url + "/metrics"
    assert requests.get(url, timeout=10).status_code == 401
    assert requests.get(url, headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
    tenant_answer = requests.get(url, headers={"Authorization": f"Bearer {tenant.token}"}, timeout=10)
    assert tenant_answer.status_code == 403
    assert "orbit_" not in tenant_answer.text
    # The token travels in the Authorization header only: not a query string, not a cookie.
    assert requests.get(url, params={"token": LIVE_METRICS_TOKEN}, timeout=10).status_code == 401
    assert requests.get(url, cookies={"token": LIVE_METRICS_TOKEN}, timeout=10).status_code == 401
    operator = requests.get(url, headers={"Authorization": f"Bearer {LIVE_METRICS_TOKEN}"}, timeout=10)
    assert operator.status_code == 200 and tenant.token not in operator.text
    # A revoked tenant credential is no credential at all.
    revoke_credential(tenant.token.split("_")[1])
    assert requests.get(url, headers={"Authorization": f"Bearer {tenant.token}"}, timeout=10).status_code == 401

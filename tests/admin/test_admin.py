"""The admin is read-only: operators can look at every table, never change one."""

import pytest

from tests.conftest import post_json

PAGES = [
    "orbit/application",
    "orbit/applicationstate",
    "orbit/namespace",
    "orbit/credential",
    "orbit/auditentry",
    "orbit/event",
    "queues/queue",
    "queues/queuestate",
    "tasks/task",
    "tasks/attempt",
    "tasks/concurrencykey",
    "tasks/workeridentity",
    "plans/plan",
    "plans/planversion",
    "plans/plantrigger",
]


@pytest.mark.django_db
@pytest.mark.parametrize("page", PAGES)
def test_every_table_is_listed_and_nothing_can_be_added(operator, tenant, page):
    body = {"name": "q", "max_concurrency": 1, "rate_per_second": 1}
    post_json(tenant.client, "/v1/queues", body, key="admin-q")
    assert operator.get(f"/admin/{page}/").status_code == 200
    assert operator.get(f"/admin/{page}/add/").status_code == 403


@pytest.mark.django_db
def test_a_queue_cannot_be_changed_or_deleted(operator, tenant):
    body = {"name": "q", "max_concurrency": 1, "rate_per_second": 1}
    queue = post_json(tenant.client, "/v1/queues", body, key="admin-q").json()["data"]["queue"]
    response = operator.post(f"/admin/queues/queue/{queue['id']}/change/", {"max_concurrency": 99})
    assert response.status_code == 403
    assert operator.post(f"/admin/queues/queue/{queue['id']}/delete/", {"post": "yes"}).status_code == 403
    assert tenant.client.get(f"/v1/queues/{queue['id']}").json()["data"]["max_concurrency"] == 1


@pytest.mark.django_db
@pytest.mark.parametrize("object_id", ["%C2%B2", "%C2%B9", "%D9%A3", "zzz"])
def test_a_key_page_for_an_id_that_is_no_number_goes_back_to_the_index(operator, object_id):
    """ "²" passed str.isdigit() and then failed the integer lookup: a 500."""
    response = operator.get(f"/admin/tasks/concurrencykey/{object_id}/change/")
    assert response.status_code == 302 and response["Location"] == "/admin/"

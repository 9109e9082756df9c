"""A queue's task list newest first, ordered by an index that exists
(idx_task_ns_queue), and the console's labels in English."""

from __future__ import annotations

import pytest
from django.db import connection

from orbit.models import AuditEntry
from tasks.models import WorkerIdentity
from tests.support.api import make_queue
from tests.support.tasks import submit_ok

pytestmark = pytest.mark.django_db


def test_a_queues_tasks_list_newest_first_through_the_namespace_queue_index(operator, tenant):
    queue = make_queue(tenant.client)
    made = [submit_ok(tenant.client, queue["id"], f"t-{n}")["id"] for n in range(4)]
    response = operator.get(f"/admin/tasks/task/?q={queue['id']}")
    cl = response.context["cl"]
    assert tuple(cl.queryset.query.order_by) == ("-created_at", "-pk")
    assert [row.pk for row in cl.result_list] == made[::-1]
    if connection.vendor == "mysql":
        sql, params = cl.queryset[:100].query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN " + sql, params)
            columns = [c[0] for c in cursor.description]
            plans = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
        # On four rows the optimizer may read the table; the index is there to
        # take: equal on (namespace_id, queue_id), then created_at and the id.
        assert "idx_task_ns_queue" in (plans[0]["possible_keys"] or ""), plans
    where = str(cl.queryset.query.where)
    assert "namespace_id" in where and "queue_id" in where


def test_plural_names_and_a_count_of_one(operator, tenant):
    assert AuditEntry._meta.verbose_name_plural == "audit entries"
    assert WorkerIdentity._meta.verbose_name_plural == "worker identities"
    queue = make_queue(tenant.client)
    task = submit_ok(tenant.client, queue["id"], "only")
    page = operator.get(f"/admin/tasks/task/?q={task['id']}").content.decode()
    assert "1 result " in page or "1 result<" in page or "1 result (" in page
    assert "1 results" not in page and "View site" not in page

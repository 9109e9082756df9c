"""The console's task page and dependencies (SPEC §13): its dependencies in
depends_on order and its dependents, each linked with its state, a pruned one
by its id as gone; a BLOCKED task's blocked_by and on_dependency_failure; the
graph drawn as inline SVG; a fan-out of 10,000 dependents in a bounded number
of queries; BLOCKED wherever the console lists states."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from django.db import connection
from django.template.loader import render_to_string
from django.test.utils import CaptureQueriesContext

from console import data
from console.dependency_graph import task_graph
from tasks.models import Task
from tests.conftest import post_json
from tests.support.api import make_queue
from tests.support.tasks import cancel, lease_one, report, start, submit_ok, task_body

pytestmark = pytest.mark.django_db


@pytest.fixture
def queue(tenant: Any) -> dict[str, Any]:
    return make_queue(tenant.client, max_concurrency=100, rate_per_second=1000, max_unfinished_tasks=20_000)


def page_of(operator: Any, task_id: str, query: str = "") -> str:
    response = operator.get(f"/admin/tasks/task/{task_id}/change/{query}")
    assert response.status_code == 200, response.content[:500]
    return response.content.decode()


def rows_of(html: str, kind: str) -> list[tuple[str, str]]:
    """(task id, state) of each row of the dependencies or dependents table, in page order."""
    return re.findall(rf'<tr class="orbit-{kind}" data-task="([0-9a-f]+)" data-state="([A-Z_a-z]+)">', html)


def graph_nodes(html: str) -> list[tuple[str, str, str, str]]:
    """(element, kind, task id, state) of each node of the graph."""
    svg = html[html.index('<svg id="task-graph-svg"') : html.index("</svg>", html.index('<svg id="task-graph-svg"'))]
    node = r'<(a|g) class="orbit-node orbit-node-(\w+)"(?: href="[^"]*")? data-task="(\w*)" data-state="([^"]*)"'
    return re.findall(node, svg)


def run_next(tenant: Any, queue_id: str, outcome: str = "SUCCEEDED") -> dict[str, Any]:
    lease = lease_one(tenant, queue_id)
    start(lease)
    report(lease, outcome, error=None if outcome == "SUCCEEDED" else {"code": "boom"})
    return lease


def join_world(tenant: Any, queue: dict[str, Any]) -> dict[str, Any]:
    """A join under RUN waiting for three parents: one succeeded, one cancelled, one still waiting."""
    done = submit_ok(tenant.client, queue["id"], "done", handler="first")
    run_next(tenant, queue["id"])
    dropped = submit_ok(tenant.client, queue["id"], "dropped", handler="second")
    cancel(tenant.client, dropped["id"], "cancel-dropped")
    pending = submit_ok(tenant.client, queue["id"], "pending", handler="third")
    join = submit_ok(
        tenant.client,
        queue["id"],
        "join",
        handler="join",
        depends_on=[pending["id"], done["id"], dropped["id"]],
        on_dependency_failure="RUN",
    )
    return {"done": done, "dropped": dropped, "pending": pending, "join": join}


def test_a_join_lists_its_dependencies_in_depends_on_order_each_linked_with_its_state(operator, tenant, queue):
    world = join_world(tenant, queue)
    html = page_of(operator, world["join"]["id"])

    assert rows_of(html, "dependency") == [
        (world["pending"]["id"], "WAITING"),
        (world["done"]["id"], "SUCCEEDED"),
        (world["dropped"]["id"], "CANCELLED"),
    ]
    for parent in ("pending", "done", "dropped"):
        assert f'href="/admin/tasks/task/{world[parent]["id"]}/change/"' in html
    assert "Dependencies (3)" in html
    assert "None: no task waits for this one." in html


def test_a_blocked_task_shows_blocked_by_on_dependency_failure_and_what_it_waits_for(operator, tenant, queue):
    world = join_world(tenant, queue)
    assert Task.objects.get(id=world["join"]["id"]).state == "BLOCKED"
    html = page_of(operator, world["join"]["id"])

    assert '<strong id="task-blocked-by">1</strong>' in html
    assert '<strong id="task-on-dependency-failure">RUN</strong>' in html
    assert "it has finished and will not run again" not in html
    waiting = html[html.index('data-code="WAITING_FOR_DEPENDENCIES"') :]
    waiting = waiting[: waiting.index("</li>")]
    assert world["pending"]["id"] in waiting and world["done"]["id"] not in waiting


def test_a_parent_lists_its_dependents_with_their_state_blocked_by_and_policy(operator, tenant, queue):
    world = join_world(tenant, queue)
    html = page_of(operator, world["pending"]["id"])

    assert rows_of(html, "dependent") == [(world["join"]["id"], "BLOCKED")]
    row = html[html.index('<tr class="orbit-dependent"') :]
    row = row[: row.index("</tr>")]
    assert f'href="/admin/tasks/task/{world["join"]["id"]}/change/"' in row
    assert "<td>1</td><td>RUN</td>" in row  # blocked_by, on_dependency_failure
    assert '<span id="task-dependents-count">1</span>' in html


def test_a_pruned_dependency_is_shown_by_its_id_as_gone(operator, tenant, queue):
    world = join_world(tenant, queue)
    Task.objects.filter(id=world["done"]["id"]).delete()  # as orbit_prune would, were nothing waiting
    html = page_of(operator, world["join"]["id"])

    assert rows_of(html, "dependency")[1] == (world["done"]["id"], "gone")
    assert f'href="/admin/tasks/task/{world["done"]["id"]}/change/"' not in html
    assert ("g", "gone", world["done"]["id"], "gone") in graph_nodes(html)


def test_the_graph_draws_the_task_between_its_parents_and_children(operator, tenant, queue):
    world = join_world(tenant, queue)
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[world["join"]["id"]])
    html = page_of(operator, world["join"]["id"])

    nodes = graph_nodes(html)
    assert nodes[0] == ("a", "self", world["join"]["id"], "BLOCKED")
    assert nodes[1:] == [
        ("a", "parent", world["pending"]["id"], "WAITING"),
        ("a", "parent", world["done"]["id"], "SUCCEEDED"),
        ("a", "parent", world["dropped"]["id"], "CANCELLED"),
        ("a", "child", child["id"], "BLOCKED"),
    ]
    svg = html[html.index('<svg id="task-graph-svg"') :]
    svg = svg[: svg.index("</svg>")]
    assert svg.count('class="orbit-edge') == 4
    assert '<text class="orbit-node-state"' in svg and ">SUCCEEDED</text>" in svg
    assert 'fill="#b9e0a5" stroke="#3d7a2a"' in svg  # SUCCEEDED's colours
    assert "<script" not in html[html.index('id="task-graph"') : html.index("</svg>")]


def test_a_join_of_25_draws_20_parents_and_a_more_node_for_the_rest(operator, tenant, queue):
    parents = [submit_ok(tenant.client, queue["id"], f"parent-{n}")["id"] for n in range(25)]
    join = submit_ok(tenant.client, queue["id"], "join", depends_on=parents)
    html = page_of(operator, join["id"])

    nodes = graph_nodes(html)
    assert [task_id for _, kind, task_id, _ in nodes if kind == "parent"] == parents[: data.GRAPH_NODES]
    assert nodes[-1][:2] == ("a", "more") and ">+5 more</text>" in html
    assert 'href="#task-dependencies"' in html
    assert [task_id for task_id, _ in rows_of(html, "dependency")] == parents


def test_a_task_without_dependencies_or_dependents_draws_no_graph(operator, tenant, queue):
    alone = submit_ok(tenant.client, queue["id"], "alone")
    html = page_of(operator, alone["id"])
    assert 'id="task-graph-svg"' not in html
    assert "None: the task waits for no other task." in html


def test_the_graph_escapes_every_text_it_draws():
    hostile = '</text><script>alert("x")</script>'
    parent = data.Linked(task_id="a" * 32, state="SUCCEEDED", handler=hostile)
    itself = data.Linked(task_id="b" * 32, state="BLOCKED", handler="join")
    page = data.LinkedPage(rows=[parent], number=1, per_page=100, count=1)
    empty = data.LinkedPage(rows=[], number=1, per_page=100, count=0)
    hrefs = {parent.task_id: '/x/"onmouseover="alert(1)', itself.task_id: "/b/"}
    graph = task_graph(itself, [parent], page, [], empty, hrefs)
    html = render_to_string("admin/tasks/task/dependency_graph.html", {"graph": graph, "task": itself})
    assert "<script>" not in html and '"onmouseover=' not in html
    assert "&lt;/text&gt;&lt;script&gt;" in html and "&quot;onmouseover=&quot;" in html


def submit_fan_out(tenant: Any, queue_id: str, parent_id: str, count: int) -> None:
    for first in range(0, count, 500):
        items = [
            {"idempotency_key": f"fan-{parent_id}-{n}", "task": task_body(queue_id, depends_on=[parent_id])}
            for n in range(first, min(count, first + 500))
        ]
        response = post_json(tenant.client, "/v1/tasks:batch", {"tasks": items})
        assert response.status_code in (200, 201), response.content[:500]


def timed_page(operator: Any, task_id: str, query: str = "") -> tuple[str, int, float]:
    with CaptureQueriesContext(connection) as queries:
        started = time.perf_counter()
        html = page_of(operator, task_id, query)
        elapsed = time.perf_counter() - started
    if connection.vendor == "mysql":
        assert_dependents_read_along_their_index(queries.captured_queries)
    return html, len(queries.captured_queries), elapsed


def assert_dependents_read_along_their_index(captured: list[dict[str, str]]) -> None:
    """The dependents' page, count and graph read idx_dependency_parent in its order: no scan, no sort."""
    reads = [q["sql"] for q in captured if "`orbit_task_dependency`" in q["sql"] and "`depends_on_id` =" in q["sql"]]
    assert reads
    with connection.cursor() as cursor:
        for sql in reads:
            cursor.execute("EXPLAIN " + sql)
            columns = [c[0] for c in cursor.description]
            plans = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
            table = [plan for plan in plans if plan["table"] == "orbit_task_dependency"]
            assert table and table[0]["key"] == "idx_dependency_parent", (sql, plans)
            assert "filesort" not in (table[0]["Extra"] or ""), (sql, plans)


def test_a_fan_out_of_10000_dependents_pages_in_the_same_queries_as_one(operator, tenant, queue):
    small = submit_ok(tenant.client, queue["id"], "small")
    submit_fan_out(tenant, queue["id"], small["id"], 1)
    wide = submit_ok(tenant.client, queue["id"], "wide")
    submit_fan_out(tenant, queue["id"], wide["id"], 10_000)

    page_of(operator, wide["id"])  # templates and caches warm
    _, small_queries, small_elapsed = timed_page(operator, small["id"])
    html, wide_queries, elapsed = timed_page(operator, wide["id"])
    print(f"task page with 10,000 dependents: {elapsed * 1000:.0f} ms, {wide_queries} queries")
    print(f"task page with 1 dependent: {small_elapsed * 1000:.0f} ms, {small_queries} queries")

    assert wide_queries == small_queries  # no query per dependent
    assert elapsed < 2.0
    assert '<span id="task-dependents-count">10,000</span>' in html
    assert len(rows_of(html, "dependent")) == data.DEPENDENCIES_PER_PAGE
    assert "1–100 of 10,000" in html and 'id="task-dependents-more"' in html
    assert 'href="?dependents_page=2#task-dependents"' in html and 'href="?dependents_page=100#task-dependents"' in html
    nodes = graph_nodes(html)
    assert [kind for _, kind, _, _ in nodes].count("child") == data.GRAPH_NODES
    assert nodes[-1][1] == "more" and ">+9,980 more</text>" in html

    last, last_queries, _ = timed_page(operator, wide["id"], "?dependents_page=100")
    assert len(rows_of(last, "dependent")) == 100 and "9,901–10,000 of 10,000" in last
    assert last_queries == wide_queries + 1  # the graph's first children read apart from the page
    assert 'class="orbit-page-next"' not in last
    first_ids = {task_id for task_id, _ in rows_of(html, "dependent")}
    assert not first_ids & {task_id for task_id, _ in rows_of(last, "dependent")}


@pytest.mark.parametrize("value", ["abc", "-3", "0", "99999999999"])
def test_a_bad_page_number_is_the_first_or_last_page(operator, tenant, queue, value):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    submit_fan_out(tenant, queue["id"], parent["id"], 3)
    html = page_of(operator, parent["id"], f"?dependents_page={value}&dependencies_page={value}")
    assert len(rows_of(html, "dependent")) == 3


def test_blocked_is_a_state_of_the_task_list_filter_the_dashboard_and_the_queue_list(operator, tenant, queue):
    world = join_world(tenant, queue)
    listing = operator.get("/admin/tasks/task/")
    assert "?state__exact=BLOCKED" in listing.content.decode()
    blocked = operator.get("/admin/tasks/task/?state__exact=BLOCKED")
    assert [str(task.pk) for task in blocked.context["cl"].result_list] == [world["join"]["id"]]

    (row,) = data.queue_rows([queue["id"]])
    assert (row.blocked, row.waiting) == (1, 1)  # the join is not counted as waiting
    dashboard = operator.get("/admin/").content.decode()
    assert 'class="orbit-state-BLOCKED">BLOCKED <strong>1</strong>' in dashboard
    assert f'?state__exact=BLOCKED&amp;q={queue["id"]}">B 1</a>' in dashboard
    assert 'data-state="BLOCKED" data-count="1"' in dashboard
    queues = operator.get("/admin/queues/queue/").content.decode()
    assert '<th scope="col" class="column-blocked">' in queues and '<td class="field-blocked">1</td>' in queues

"""A join task's page in Chromium (SPEC §13): its dependency graph drawn as
inline SVG with its parents on the left, each coloured by its state with the
state written, and a parent's node opening that parent's page, which shows
the join among its dependents."""

from __future__ import annotations

from typing import Any

import pytest

from tests.console.conftest import screenshot
from tests.support.api import make_queue
from tests.support.console import Tenant
from tests.support.tasks import lease_one, report, run_threads, start, submit_ok

pytestmark = pytest.mark.django_db(transaction=True)


def join_world() -> dict[str, Any]:
    """A join waiting for two parents: the first succeeded, the second still waiting."""
    tenant = Tenant()
    queue = make_queue(tenant.client, "joins", max_concurrency=10, rate_per_second=100)
    first = submit_ok(tenant.client, queue["id"], "first", handler="extract")
    lease = lease_one(tenant, queue["id"])
    start(lease)
    report(lease, "SUCCEEDED", output={"rows": 3})
    second = submit_ok(tenant.client, queue["id"], "second", handler="transform")
    join = submit_ok(tenant.client, queue["id"], "join", handler="load", depends_on=[first["id"], second["id"]])
    return {"first": first, "second": second, "join": join}


def test_a_joins_graph_shows_its_parents_and_a_parent_node_opens_its_page(operator_page):
    world = run_threads(1, lambda _: join_world())[0]  # the API's views off Playwright's loop
    page = operator_page
    page.goto(f"/admin/tasks/task/{world['join']['id']}/change/")

    graph = page.locator("#task-graph svg#task-graph-svg")
    assert graph.is_visible()
    itself = graph.locator("a.orbit-node-self")
    assert itself.get_attribute("data-task") == world["join"]["id"]
    assert itself.locator("text.orbit-node-state").inner_html() == "BLOCKED"
    parents = graph.locator("a.orbit-node-parent")
    assert [parents.nth(n).get_attribute("data-task") for n in range(parents.count())] == [
        world["first"]["id"],
        world["second"]["id"],
    ]
    first = graph.locator(f"a.orbit-node-parent[data-task='{world['first']['id']}']")
    second = graph.locator(f"a.orbit-node-parent[data-task='{world['second']['id']}']")
    assert first.locator("text.orbit-node-state").inner_html() == "SUCCEEDED"
    assert second.locator("text.orbit-node-state").inner_html() == "WAITING"
    assert first.locator("rect").get_attribute("fill") != second.locator("rect").get_attribute("fill")
    # Parents are drawn left of the task.
    assert first.bounding_box()["x"] < itself.bounding_box()["x"]
    assert page.inner_text("#task-blocked-by") == "1"
    screenshot(page, "join-graph.png")

    first.click()
    page.wait_for_url(f"**/admin/tasks/task/{world['first']['id']}/change/")
    child = page.locator(f"#task-graph-svg a.orbit-node-child[data-task='{world['join']['id']}']")
    assert child.locator("text.orbit-node-state").inner_html() == "BLOCKED"
    assert page.locator(f"#task-dependents tr.orbit-dependent[data-task='{world['join']['id']}']").count() == 1
    screenshot(page, "join-parent.png")

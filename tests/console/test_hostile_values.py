"""Values a tenant controls, as the console shows them to operators: a
tenant with only an API token writes task payloads and keys, business and
fairness keys, worker ids, outputs and errors, key policy matches and audit
reasons. None of them may run script, break the page's markup, reorder the
console's own text (a Unicode right-to-left override), change where a
console link leads, or make a list page count the whole table."""

from __future__ import annotations

import html
import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tests.console.conftest import screenshot
from tests.support.api import make_queue
from tests.support.console import Tenant
from tests.support.key_policies import create_ok
from tests.support.tasks import cancel, lease_one, report, run_threads, start, submit_ok

RTL_OVERRIDE = "\u202e"
HOSTILE = [
    "<img src=x onerror=alert(1)>",
    "</script><script>alert(2)</script>",
    "javascript:alert(3)",
    "\"'><svg onload=alert(4)>",
    "{{ 7|add:7 }}{% debug %}",
]
# printable ASCII without spaces: what a hello's worker_id may hold
HOSTILE_WORKER = "<img/src=x/onerror=alert('w')>&state__exact=RUNNING#x+y%"


def hostile_world() -> dict[str, Any]:
    """Every string a tenant writes, hostile: made on a thread of its own (the
    API's in-process views cannot run where Playwright's loop runs)."""

    def make(_: int) -> dict[str, Any]:
        tenant = Tenant()
        queue = make_queue(tenant.client, "hostile", max_concurrency=8, rate_per_second=50)
        tasks = []
        for n, text in enumerate(HOSTILE):
            tasks.append(
                submit_ok(
                    tenant.client,
                    queue["id"],
                    f"{text}-{n}",
                    business_key=f"{text}-b{n}",
                    concurrency_key=f"{text}-k{n}",
                    fairness_key=f"{text}-f{n}",
                    payload={"text": text, text: [text]},
                )
            )
        create_ok(tenant.client, key="policy-1", match={"key": f"{HOSTILE[0]}-k0"}, capacity=2, reason=HOSTILE[1])
        create_ok(tenant.client, key="policy-2", match={"prefix": HOSTILE[3]}, capacity=3, reason=HOSTILE[0])
        assert cancel(tenant.client, tasks[-1]["id"], "cancel-1", reason=HOSTILE[3]).status_code == 200
        # Ended by a worker whose id, output and error are hostile.
        for outcome in ("SUCCEEDED", "FAILED"):
            lease = lease_one(tenant, queue["id"], worker_id=HOSTILE_WORKER)
            start(lease)
            report(
                lease,
                outcome,
                output={"out": HOSTILE[0], HOSTILE[1]: HOSTILE[3]} if outcome == "SUCCEEDED" else None,
                error={"type": HOSTILE[1], "message": HOSTILE[0] + HOSTILE[3]} if outcome == "FAILED" else None,
            )
        # A key held by that worker, and a sibling waiting behind it (KEY_HELD names the worker).
        holding = make_queue(tenant.client, "holding")
        held = submit_ok(tenant.client, holding["id"], "held", concurrency_key=HOSTILE[0], lease_seconds=3600)
        lease = lease_one(tenant, holding["id"], worker_id=HOSTILE_WORKER)
        assert lease["task"]["id"] == held["id"]
        start(lease)
        waiting = submit_ok(tenant.client, holding["id"], "waiting", concurrency_key=HOSTILE[0])
        child = submit_ok(
            tenant.client, queue["id"], "child", depends_on=[tasks[0]["id"], waiting["id"]], business_key=HOSTILE[2]
        )
        spoof = submit_ok(
            tenant.client,
            queue["id"],
            "spoof",
            concurrency_key="acct" + RTL_OVERRIDE + "gnissim",
            payload={"amount": RTL_OVERRIDE + "0001 DSU"},
        )
        return {
            "tenant": tenant,
            "queue": queue,
            "tasks": tasks,
            "held": held,
            "waiting": waiting,
            "child": child,
            "spoof": spoof,
        }

    return run_threads(1, make)[0]


INJECTED = """() => {
  const found = [];
  for (const e of document.querySelectorAll('img[src="x"], svg[onload], script:not([src])')) {
    if (e.tagName !== 'SCRIPT' || /alert/.test(e.textContent)) found.push(e.outerHTML.slice(0, 120));
  }
  for (const e of document.querySelectorAll('*')) for (const a of e.attributes) {
    if (/^on/i.test(a.name)) found.push(`${e.tagName} ${a.name}`);
    if (['href', 'src', 'action'].includes(a.name) && /^\\s*javascript:/i.test(a.value)) found.push(a.value);
  }
  return found;
}"""


@pytest.mark.django_db(transaction=True)
def test_hostile_values_run_no_script_and_inject_no_markup(operator_page):
    world = hostile_world()
    page = operator_page
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    pages = [
        "/admin/",
        "/admin/tasks/task/",
        f"/admin/tasks/task/?q={world['queue']['id']}",
        "/admin/tasks/attempt/",
        "/admin/tasks/concurrencykey/",
        "/admin/tasks/keypolicy/",
        "/admin/tasks/workeridentity/",
        "/admin/orbit/auditentry/",
        *[f"/admin/tasks/task/{task['id']}/change/" for task in world["tasks"]],
        *[f"/admin/tasks/task/{world[name]['id']}/change/" for name in ("held", "waiting", "child")],
    ]
    visited = []
    while pages:
        url = pages.pop(0)
        if url in visited:
            continue
        visited.append(url)
        assert page.goto(url).status == 200, url
        assert page.evaluate(INJECTED) == [], url
        if url.endswith("/change/"):
            # and every console page a task page links to: key, attempt, worker, policy pages
            for href in page.eval_on_selector_all(
                "#content a[href^='/admin/']", "links => links.map(a => a.getAttribute('href'))"
            ):
                if any(part in href for part in ("/concurrencykey/", "/attempt/", "/workeridentity/", "/keypolicy/")):
                    pages.append(href)
    assert len(visited) > 20
    assert dialogs == [] and errors == []
    # Shown, as text.
    page.goto(f"/admin/tasks/task/{world['tasks'][0]['id']}/change/")
    assert HOSTILE[0] in page.inner_text("#task-payload pre")
    assert HOSTILE[0] in page.inner_text("#task-key-link")
    screenshot(page, "hostile-task.png")


@pytest.mark.django_db(transaction=True)
def test_a_right_to_left_override_stays_inside_the_value_that_holds_it(operator_page):
    """U+202E reverses everything after it up to the end of its paragraph: a
    key holding one must not turn the console's own words around it."""
    world = hostile_world()
    page = operator_page
    page.goto(f"/admin/tasks/task/{world['spoof']['id']}/change/")
    screenshot(page, "hostile-rtl.png")
    after_the_key = page.locator("#task-links a", has_text="attempts in the attempt list")
    first, last = after_the_key.evaluate(
        """a => {
          const text = a.firstChild, range = document.createRange(), x = [];
          for (const at of [0, text.length - 1]) {
            range.setStart(text, at); range.setEnd(text, at + 1); x.push(range.getBoundingClientRect().left);
          }
          return x;
        }"""
    )
    assert first < last, "the link's text after the key is drawn right to left"


@pytest.mark.django_db
def test_the_payload_shows_a_direction_override_as_its_escape(operator, tenant):
    """A payload string "\\u202e0001 DSU" must not read "USD 1000" on the task page."""
    queue = make_queue(tenant.client)
    task = submit_ok(tenant.client, queue["id"], "spoof", payload={"amount": RTL_OVERRIDE + "0001 DSU"})
    page = operator.get(f"/admin/tasks/task/{task['id']}/change/").content.decode()
    (payload,) = re.findall(
        r'<div class="orbit-panel" id="task-payload">.*?<pre class="orbit-json">(.*?)</pre>', page, re.S
    )
    assert RTL_OVERRIDE not in payload
    assert "\\u202e0001 DSU" in html.unescape(payload)


@pytest.mark.django_db
def test_a_workers_link_searches_for_its_whole_id(operator, tenant):
    """The worker a KEY_HELD blocker names links to the worker list searched
    for that id: the id's &, #, + and % are the search's, not the link's."""
    worker_id = "w&state__exact=RUNNING#x+y%"
    queue = make_queue(tenant.client)
    held = submit_ok(tenant.client, queue["id"], "held", concurrency_key="acct/1", lease_seconds=3600)
    lease = lease_one(tenant, queue["id"], worker_id=worker_id)
    assert lease["task"]["id"] == held["id"]
    start(lease)
    sibling = submit_ok(tenant.client, queue["id"], "sibling", concurrency_key="acct/1")
    page = operator.get(f"/admin/tasks/task/{sibling['id']}/change/").content.decode()
    hrefs = [html.unescape(href) for href in re.findall(r'href="(/admin/tasks/workeridentity/[^"]*)"', page)]
    assert hrefs, "the blocker names no worker"
    for href in hrefs:
        split = urlsplit(href)
        assert split.fragment == "" and parse_qs(split.query) == {"q": [worker_id]}, href
        listing = operator.get(href)
        assert listing.status_code == 200, href
        assert listing.context["cl"].query == worker_id  # the term searched (lease_one makes no identity row)


@pytest.mark.django_db
@pytest.mark.parametrize("page", ["tasks/task", "tasks/attempt", "orbit/auditentry", "queues/queue", "plans/plan"])
def test_no_list_counts_the_whole_table_for_facets(operator, tenant, page):
    """Django 5's "Show counts" (?_facets) counts every filter choice over the
    whole list, uncapped: the console's counts stop at ADMIN_ROW_CAP."""
    queue = make_queue(tenant.client)
    submit_ok(tenant.client, queue["id"], "t")
    with CaptureQueriesContext(connection) as plain:
        listing = operator.get(f"/admin/{page}/")
    assert listing.status_code == 200
    assert "_facets" not in listing.content.decode(), "the list offers Show counts"
    with CaptureQueriesContext(connection) as faceted:
        answer = operator.get(f"/admin/{page}/?_facets=1")
    assert answer.status_code in (200, 400)
    statements = [q["sql"] for q in faceted.captured_queries]
    extra = [sql for sql in statements if sql not in {q["sql"] for q in plain.captured_queries}]
    assert [sql for sql in extra if "COUNT(" in sql.upper()] == []


@pytest.mark.django_db
@pytest.mark.parametrize(
    "query",
    [
        "tasks/task/?state__regex=.",
        "tasks/task/?state__contains=I",
        "tasks/attempt/?state__startswith=R",
        "orbit/auditentry/?action__regex=.",
        "queues/queue/?paused__gt=0",
    ],
)
def test_a_declared_filter_takes_only_its_own_lookups(operator, tenant, query):
    """Only the declared filters apply, and only as their choices do (exact):
    a regex or substring lookup on the same column reads every row."""
    assert operator.get(f"/admin/{query}").status_code == 400

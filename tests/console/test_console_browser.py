"""The console, opened in Chromium under the production server (orbit.serve):
logged in, styled, the dashboard's charts drawn from data, a queue, a task
with its attempts, a key's token history, a blocked task's reasons, and every
Orbit model refusing add, change and delete, on the page and to a direct POST."""

from __future__ import annotations

import pytest
from django.contrib import admin

from tasks.models import Attempt, ConcurrencyKey
from tests.console.conftest import screenshot
from tests.support.console import busy_world

pytestmark = pytest.mark.django_db(transaction=True)


def test_log_in_and_the_stylesheet_is_applied(operator_page):
    page = operator_page
    statuses: dict[str, int] = {}
    page.on("response", lambda response: statuses.__setitem__(response.url.split("/static/", 1)[-1], response.status))
    page.goto("/admin/")
    assert page.inner_text("#site-name") == "Orbit console"
    assert statuses.get("admin/css/base.css") == 200, statuses
    assert statuses.get("orbit/console.css") == 200, statuses
    # Unstyled, the header's background is transparent and the body's font the browser's serif.
    header = page.eval_on_selector("#header", "e => getComputedStyle(e).backgroundColor")
    assert header == "rgb(43, 95, 138)"
    font = page.eval_on_selector("body", "e => getComputedStyle(e).fontFamily")
    assert "serif" != font.strip().lower() and "Times" not in font
    assert page.request.get("/static/admin/css/base.css").status == 200


def test_the_dashboard_draws_its_charts(operator_page):
    world = busy_world()
    page = operator_page
    page.goto("/admin/")
    assert page.locator("meta[http-equiv=refresh]").get_attribute("content") == "5"
    assert page.locator("svg.orbit-chart").count() >= 8
    card = page.locator(f"article[data-queue='{world['billing']['id']}']")
    waiting = card.locator("rect.orbit-part[data-state=WAITING]")
    assert int(waiting.get_attribute("data-count")) == 6
    assert int(card.locator("rect.orbit-part[data-state=RUNNING]").get_attribute("data-count")) == 1
    assert float(waiting.get_attribute("width")) > 0
    assert card.locator("svg.orbit-minutes rect.orbit-start").count() == 1  # this minute's start, from the rollup
    assert "1 of 4" in card.inner_text()
    assert page.locator("article.orbit-paused").count() == 1
    screenshot(page, "dashboard.png")


def test_a_queue_a_task_with_its_attempts_and_a_keys_token_history(operator_page):
    world = busy_world()
    page = operator_page
    page.goto("/admin/queues/queue/")
    row = page.locator("#result_list tbody tr", has_text="billing")
    assert "1 of 4" in row.inner_text() and "running" in row.inner_text()
    assert "paused" in page.locator("#result_list tbody tr", has_text="reports").inner_text()
    screenshot(page, "queues.png")
    row.locator("a", has_text="tasks").click()
    page.wait_for_url("**/admin/tasks/task/?q=*")
    assert page.locator("#result_list tbody tr").count() == 7
    page.goto(f"/admin/tasks/task/{world['held']['id']}/change/")
    attempt = Attempt.objects.get(task_id=world["held"]["id"])
    attempts = page.locator("#task-attempts tr.orbit-attempt")
    assert attempts.count() == 1
    assert attempt.id == attempts.first.get_attribute("data-attempt")
    assert "worker-1" in attempts.first.inner_text() and str(attempt.concurrency_token) in attempts.first.inner_text()
    assert '"invoice": 7' in page.inner_text("#task-payload pre")
    screenshot(page, "task.png")
    page.click("#task-key-link")
    page.wait_for_url("**/admin/tasks/concurrencykey/*/change/")
    row = ConcurrencyKey.objects.get(key="acct/42")
    assert page.inner_text("#key-holder-attempt") == attempt.id
    assert page.inner_text("#key-highest-token") == str(row.version)
    assert page.inner_text("#key-waiting") == "1"
    tokens = page.locator("#key-token-history tr.orbit-token")
    assert tokens.count() == 1 and tokens.first.get_attribute("data-token") == str(attempt.concurrency_token)
    screenshot(page, "key.png")


def test_a_blocked_tasks_reasons(operator_page):
    world = busy_world()
    page = operator_page
    page.goto(f"/admin/tasks/task/{world['blocked']['id']}/change/")
    codes = [item.get_attribute("data-code") for item in page.locator("#task-blockers li.orbit-blocker").all()]
    assert "KEY_HELD" in codes, codes
    assert world["held"]["id"] in page.inner_text("#task-blockers")
    screenshot(page, "blocked.png")
    page.goto(f"/admin/tasks/task/{world['paused_task']['id']}/change/")
    codes = [item.get_attribute("data-code") for item in page.locator("#task-blockers li.orbit-blocker").all()]
    assert "QUEUE_PAUSED" in codes, codes


def test_every_orbit_model_refuses_add_change_and_delete(operator_page):
    busy_world()
    page = operator_page
    csrf = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
    headers = {"X-CSRFToken": csrf, "Referer": page.url}
    checked = 0
    for model in admin.site._registry:
        opts = model._meta
        if opts.app_label not in {"orbit", "queues", "tasks", "workers", "plans"}:
            continue
        base = f"/admin/{opts.app_label}/{opts.model_name}/"
        listing = page.goto(base)
        assert listing.status == 200, base
        assert page.locator(".object-tools a.addlink").count() == 0, base  # (the sidebar offers auth's)
        assert page.goto(base + "add/").status == 403, base
        refused = page.request.post(base + "add/", form={"csrfmiddlewaretoken": csrf}, headers=headers)
        assert refused.status == 403 and "CSRF" not in refused.text(), base
        obj = model.objects.first()
        if obj is None:
            continue
        assert page.goto(f"{base}{obj.pk}/change/").status == 200, base
        assert page.locator("input[name=_save], input[name=_continue], a.deletelink").count() == 0, base
        for action in ("change", "delete"):
            refused = page.request.post(
                f"{base}{obj.pk}/{action}/", form={"csrfmiddlewaretoken": csrf, "post": "yes"}, headers=headers
            )
            assert refused.status == 403 and "CSRF" not in refused.text(), (base, action)
        assert model.objects.filter(pk=obj.pk).exists(), base
        checked += 1
    assert checked >= 10

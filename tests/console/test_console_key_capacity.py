"""The console's key page in Chromium for a key of capacity 3 (SPEC §12): its policy linked
with its match, capacity and rate, its three holders by slot with their tokens, attempts,
tasks and workers, and its rate state."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.models import Attempt, ConcurrencyKey
from tests.console.conftest import screenshot
from tests.support.api import make_queue
from tests.support.console import Tenant
from tests.support.key_rows import make_policy
from tests.support.tasks import lease_one, run_threads, start, submit_ok

pytestmark = pytest.mark.django_db(transaction=True)


def capacity_world() -> dict[str, Any]:
    """A key of capacity 3 (rate 20 per second, burst 5) held by three attempts, one started."""
    tenant = Tenant()
    policy = make_policy(tenant.namespace, prefix="printer/", capacity=3, rate=(20, 1, 5))
    queue = make_queue(tenant.client, "printing", max_concurrency=10, rate_per_second=100)
    for n in range(4):
        submit_ok(tenant.client, queue["id"], f"job-{n}", concurrency_key="printer/9")
    leases = [lease_one(tenant, queue["id"], worker_id=f"worker-{n}") for n in range(3)]
    start(leases[0])
    return {"tenant": tenant, "policy": policy, "leases": leases}


def test_a_key_of_capacity_3_shows_its_policy_holders_by_slot_and_rate_state(operator_page):
    world = run_threads(1, lambda _: capacity_world())[0]  # the API's views off Playwright's loop
    page = operator_page
    row = ConcurrencyKey.objects.get(namespace_id=world["tenant"].namespace_id, key="printer/9")
    page.goto(f"/admin/tasks/concurrencykey/{row.pk}/change/")

    assert page.inner_text("#key-policy-id") == world["policy"].id
    assert page.inner_text("#key-capacity") == "3"
    assert page.inner_text("#key-rate-spec") == "20 per 1 s, burst 5"
    assert page.inner_text("#key-holders-count") == "3"
    slots = page.locator("#key-holders tr.orbit-slot")
    assert [slots.nth(n).get_attribute("data-slot") for n in range(slots.count())] == ["0", "1", "2"]
    for lease in world["leases"]:
        attempt = Attempt.objects.get(id=lease["attempt_id"])
        cells = page.locator(f"#key-holders tr.orbit-slot[data-slot='{attempt.concurrency_slot}'] td")
        assert cells.nth(1).inner_text() == str(attempt.concurrency_token)
        assert cells.nth(4).inner_text() == attempt.worker_id
        assert cells.nth(2).locator("a").get_attribute("href").endswith(f"/tasks/attempt/{attempt.id}/change/")
        assert cells.nth(3).locator("a").get_attribute("href").endswith(f"/tasks/task/{attempt.task_id}/change/")
    row.refresh_from_db()
    assert page.inner_text("#key-rate-reserved") == str(row.rate_reserved) == "2"  # two leased, not started
    assert page.inner_text("#key-rate-tat") != "none yet"  # one Start moved it
    assert page.inner_text("#key-next-start").endswith("Z")
    screenshot(page, "key-capacity.png")
    # the holder's attempt page is one click away
    page.locator("#key-holders tr.orbit-slot[data-slot='0'] td").nth(2).locator("a").click()
    page.wait_for_url("**/admin/tasks/attempt/*/change/")
    screenshot(page, "key-capacity-attempt.png")

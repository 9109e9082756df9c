"""The console's key page under key policies (SPEC §12): the policy (id, match, capacity,
rate), the holders by slot (slot, token, attempt, task, worker, since) and the rate state."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from console.admin_base import format_ms
from tasks.models import Attempt, ConcurrencyKey
from tests.support.api import make_queue
from tests.support.key_rows import make_policy
from tests.support.tasks import lease_one, submit_ok

pytestmark = pytest.mark.django_db


def test_a_key_of_capacity_3_lists_its_holders_by_slot_and_its_policy(operator, tenant):
    policy = make_policy(tenant.namespace, prefix="acct/", capacity=3, rate=(50, 1, 5))
    queue = make_queue(tenant.client, max_concurrency=10, rate_per_second=100)
    for n in range(4):
        submit_ok(tenant.client, queue["id"], f"t{n}", concurrency_key="acct/7")
    leases = [lease_one(tenant, queue["id"], worker_id=f"worker-{n}") for n in range(3)]
    row = ConcurrencyKey.objects.get(key="acct/7")
    page = operator.get(reverse("admin:tasks_concurrencykey_change", args=[row.pk])).content.decode()

    assert f'id="key-policy-id">{policy.id}<' in page and "prefix <strong>acct/</strong>" in page
    assert 'id="key-capacity">3<' in page and 'id="key-rate-spec">50 per 1 s, burst 5<' in page
    assert 'id="key-holders-count">3<' in page
    slots = re.findall(r'<tr class="orbit-slot" data-slot="(\d+)">(.*?)</tr>', page, re.S)
    assert [int(slot) for slot, _ in slots] == [0, 1, 2]
    for lease in leases:
        attempt = Attempt.objects.get(id=lease["attempt_id"])
        (cells,) = [cells for slot, cells in slots if int(slot) == attempt.concurrency_slot]
        assert f"<td>{attempt.concurrency_token}</td>" in cells and attempt.worker_id in cells
        assert reverse("admin:tasks_attempt_change", args=[attempt.id]) in cells
        assert reverse("admin:tasks_task_change", args=[attempt.task_id]) in cells
    assert f'id="key-rate-reserved">{row.rate_reserved}<' in page and row.rate_reserved == 3
    assert row.rate_tat is None and 'id="key-rate-tat">none yet<' in page  # leased, none started yet
    assert 'id="key-next-start"' in page


def test_a_key_without_a_policy_says_the_default_and_shows_no_rate(operator, tenant):
    queue = make_queue(tenant.client)
    submit_ok(tenant.client, queue["id"], "a", concurrency_key="m")
    lease = lease_one(tenant, queue["id"], worker_id="worker-1")
    row = ConcurrencyKey.objects.get(key="m")
    page = operator.get(reverse("admin:tasks_concurrencykey_change", args=[row.pk])).content.decode()
    assert "No policy matches it" in page and 'id="key-capacity">1<' in page
    assert f'id="key-holder-attempt">{lease["attempt_id"]}<' in page  # the seed's one holder, as before
    assert page.count('class="orbit-slot"') == 1 and 'id="key-rate"' not in page


def test_a_rate_limited_key_shows_its_state_before_its_first_lease_too(operator, tenant):
    make_policy(tenant.namespace, key="api", capacity=2, rate=(1, 60, 1))
    queue = make_queue(tenant.client)
    submit_ok(tenant.client, queue["id"], "a", concurrency_key="api")
    url = reverse("admin:tasks_concurrencykey_by_key") + f"?namespace={tenant.namespace_id}&key=api"
    page = operator.get(url).content.decode()  # no row yet: the unleased page
    assert 'id="key-capacity">2<' in page and "none yet" in page and 'id="key-rate-reserved">0<' in page
    now = timezone.now()
    row = ConcurrencyKey.objects.create(
        namespace_id=tenant.namespace_id, key="api", version=2, rate_tat=now + timedelta(seconds=30), updated_at=now
    )
    page = operator.get(reverse("admin:tasks_concurrencykey_change", args=[row.pk])).content.decode()
    assert f'id="key-rate-tat">{format_ms(row.rate_tat)}<' in page
    assert "Free: none of its 2 permits is held." in page

"""The queue the dependency tests submit to: 100 at a time, and a start rate a module
raises with QUEUE_RATE_PER_SECOND (the concurrent ones, whose threads start more)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.api import make_queue


@pytest.fixture
def queue(request: pytest.FixtureRequest, tenant: Any) -> dict[str, Any]:
    rate = getattr(request.module, "QUEUE_RATE_PER_SECOND", 1000)
    return make_queue(tenant.client, max_concurrency=100, rate_per_second=rate)

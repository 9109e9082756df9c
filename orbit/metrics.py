"""Prometheus metrics, exposed at /metrics."""

from __future__ import annotations

from django.http import HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from rest_framework.request import Request

from orbit.api.views import OrbitView

TASKS_SUBMITTED = Counter("orbit_tasks_submitted_total", "Tasks accepted by submit")
ATTEMPTS_LEASED = Counter("orbit_attempts_leased_total", "Attempts created by dispatch")
ATTEMPTS_STARTED = Counter("orbit_attempts_started_total", "Starts approved")
ATTEMPTS_FINISHED = Counter("orbit_attempts_finished_total", "Attempts ended", ["state"])
LEASES_RECOVERED = Counter("orbit_leases_recovered_total", "Expired leases recovered")

_finished_by_state: dict[str, Counter] = {}


def count_finished_attempt(state: str) -> None:
    """ATTEMPTS_FINISHED for one attempt, its labelled child looked up once per
    state (labels() validates and locks on every call, per attempt, on the round thread)."""
    child = _finished_by_state.get(state)
    if child is None:
        child = _finished_by_state[state] = ATTEMPTS_FINISHED.labels(state=state)
    child.inc()


class MetricsView(OrbitView):
    """GET /metrics: this process's counters in Prometheus' text format, for
    the bearer of any valid credential (SPEC §2: a token on every request),
    e.g. a scraper's. The counters are process-wide sums: no tenant's
    names, ids or payloads."""

    schema = None  # not part of the v1 API document

    def get(self, request: Request) -> HttpResponse:
        self.principal(request)
        return HttpResponse(generate_latest(), content_type=CONTENT_TYPE_LATEST)

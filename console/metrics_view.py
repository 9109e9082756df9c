"""GET /metrics: Prometheus metrics for the platform operator.

The counters (orbit.metrics, counted by the verbs: this process's, or with
several server processes all of theirs added up) and, per queue, gauges read
from the queue_state rows the engine keeps anyway: a scrape reads one row per
queue and never scans the task table, and they are one value whichever process
answers. Per key policy, the permits in use, summed from the key rows'
holders. Apart from the counters so that the verbs, which count, do not import
the HTTP layer."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError
from django.db.models import Count
from django.http import HttpResponse
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from rest_framework.request import Request
from rest_framework.views import APIView

from orbit import cells, metrics  # its counters register in REGISTRY on import; a scrape answers them
from orbit.db.pool import in_every_cell
from orbit.errors import NotFound, PermissionDenied, Unauthenticated, Unavailable
from orbit.models import Application, Namespace
from orbit.principal import TOKEN_PATTERN, authenticate_token, token_from_header
from queues.models import Queue, QueueState
from tasks.actions.context import RATE_WINDOW
from tasks.key_rules import policies_of
from tasks.models import ConcurrencyKey, KeyPolicy, Task, TaskState

# Queue names are unique per namespace, namespaces per application and
# environment: the four labels name one queue.
QUEUE_LABELS = ["application", "environment", "namespace", "queue"]
# A key policy's permits are the namespace's: the three name the namespace, the fourth the
# policy (its id, or "default" for the keys no policy matches: capacity 1, no rate).
KEY_POLICY_LABELS = ["application", "environment", "namespace", "policy"]
DEFAULT_POLICY_LABEL = "default"
# IN lists of at most this many queue ids per counted state.
_ID_CHUNK = 1000
# With cells, how long a scrape waits for each cell (all at once): a cell not
# answered by then is left out (orbit_cell_up 0), so a stalled cell delays a
# scrape by this much at most, well inside the request deadline.
CELL_SCRAPE_SECONDS = 2.0
# The unfinished states queue_state keeps no counter of.
COUNTED_STATES = (TaskState.BLOCKED, TaskState.NEEDS_REVIEW)


@dataclass(frozen=True)
class QueueGauges:
    labels: tuple[str, str, str, str]
    blocked: int
    waiting: int
    leased: int
    running: int
    needs_review: int
    unfinished: int
    active_permits: int
    window_count: int
    max_concurrency: int
    rate_per_second: int
    paused: bool


def _window_open(started_at: datetime | None, now: datetime) -> bool:
    return started_at is not None and now < started_at + RATE_WINDOW


def state_counts(queue_ids: list[str]) -> dict[tuple[str, str], int]:
    """BLOCKED and NEEDS_REVIEW tasks per (queue, state), counted in one
    statement as ranges of the dispatch index (queue_id, state, ...): each
    queue's rows of those states, read from the index alone. queue_state has
    no column for them (docs/decisions.md, Metrics)."""
    counts: dict[tuple[str, str], int] = {}
    for start in range(0, len(queue_ids), _ID_CHUNK):
        rows = (
            Task.objects.filter(queue_id__in=queue_ids[start : start + _ID_CHUNK], state__in=COUNTED_STATES)
            .values_list("queue_id", "state")
            .annotate(n=Count("*"))
            .order_by()
        )
        counts.update({(queue_id, state): n for queue_id, state, n in rows})
    return counts


def queue_gauges() -> list[QueueGauges]:
    """Every live queue's gauges (a retired one while it still has unfinished tasks)."""
    now = timezone.now()
    states = {
        row[0]: row
        for row in QueueState.objects.values_list(
            "queue_id", "unfinished_tasks", "active_permits", "reserved_starts", "window_started_at", "window_count"
        )
    }
    queues = list(
        Queue.objects.values_list(
            "id", "namespace_id", "name", "retired_at", "paused", "max_concurrency", "rate_per_second"
        ).order_by("id")
    )
    namespaces = {row[0]: row for row in Namespace.objects.values_list("id", "application_id", "environment", "name")}
    applications = dict(Application.objects.values_list("id", "name"))
    # Only a queue with unfinished tasks can hold BLOCKED or NEEDS_REVIEW ones.
    counted = [queue_id for queue_id, *_ in queues if states.get(queue_id, (0, 0))[1]]
    by_state = state_counts(counted)
    gauges = []
    for queue_id, namespace_id, name, retired_at, paused, max_concurrency, rate_per_second in queues:
        state = states.get(queue_id)
        namespace = namespaces.get(namespace_id)
        if state is None or namespace is None:
            continue
        _, unfinished, active, reserved, window_started_at, window_count = state
        if retired_at is not None and not unfinished:
            continue
        needs_review = by_state.get((queue_id, TaskState.NEEDS_REVIEW), 0)
        blocked = by_state.get((queue_id, TaskState.BLOCKED), 0)
        gauges.append(
            QueueGauges(
                labels=(applications.get(namespace[1], ""), namespace[2], namespace[3], name),
                # The rows are read by separate statements, each its own
                # snapshot: a difference never goes below zero. A BLOCKED task
                # counts in unfinished_tasks (SPEC §13) but is not waiting.
                blocked=blocked,
                waiting=max(0, unfinished - active - needs_review - blocked),
                leased=reserved,
                running=max(0, active - reserved),
                needs_review=needs_review,
                unfinished=unfinished,
                active_permits=active,
                window_count=window_count if _window_open(window_started_at, now) else 0,
                max_concurrency=max_concurrency,
                rate_per_second=rate_per_second,
                paused=paused,
            )
        )
    return gauges


def key_permit_gauges() -> dict[tuple[str, str, str, str], int]:
    """Valid permits in use per key policy: the holders of the key rows that
    hold any, each key resolved by its namespace's live policies now (a
    lowered capacity's remaining holders count under the policy they hold
    under now). Every live policy has its sample, 0 while none of its keys is
    held; "default" appears for a namespace while a key without a policy is held.

    Reads the key rows with holders (the key table has one row per key ever
    leased and no index on holders: a scan of it, as orbit_check's) and the
    live policies (idx_key_policy_ns_live)."""
    namespaces = {row[0]: row for row in Namespace.objects.values_list("id", "application_id", "environment", "name")}
    applications = {row[0]: row for row in Application.objects.values_list("id", "name", "key_policy_generation")}

    def labels_of(namespace_id: str, policy: str) -> tuple[str, str, str, str] | None:
        namespace = namespaces.get(namespace_id)
        if namespace is None:
            return None
        application = applications.get(namespace[1])
        return (application[1] if application else "", namespace[2], namespace[3], policy)

    gauges: dict[tuple[str, str, str, str], int] = {}
    for namespace_id, policy_id in KeyPolicy.objects.filter(live=True).values_list("namespace_id", "id"):
        labels = labels_of(namespace_id, policy_id)
        if labels is not None:
            gauges[labels] = 0
    held = ConcurrencyKey.objects.filter(holders__gt=0).values_list("namespace_id", "key", "holders")
    for namespace_id, key, holders in held.iterator():
        namespace = namespaces.get(namespace_id)
        application = applications.get(namespace[1]) if namespace is not None else None
        generation = application[2] if application is not None else 0
        rule = policies_of(namespace_id, generation).resolve(key)
        labels = labels_of(namespace_id, rule.policy_id or DEFAULT_POLICY_LABEL)
        if labels is not None:
            gauges[labels] = gauges.get(labels, 0) + holders
    return gauges


class KeyPermitCollector(Collector):
    """orbit_key_permits_in_use of one scrape."""

    def __init__(self, gauges: dict[tuple[str, str, str, str], int]) -> None:
        self.gauges = gauges

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "orbit_key_permits_in_use",
            "Valid concurrency-key permits held (LEASED + RUNNING keyed attempts), per key policy",
            labels=KEY_POLICY_LABELS,
        )
        for labels, value in sorted(self.gauges.items()):
            family.add_metric(list(labels), float(value))
        yield family


class CellCollector(Collector):
    """orbit_cell_up: with cells, whether each cell answered this scrape (a
    cell that did not has no queue gauges in it)."""

    def __init__(self, up: dict[str, bool]) -> None:
        self.up = up

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("orbit_cell_up", "1 if the cell's database answered this scrape", labels=["cell"])
        for cell, answered in self.up.items():
            family.add_metric([cell], 1.0 if answered else 0.0)
        yield family


class QueueCollector(Collector):
    """The per-queue gauges of one scrape."""

    def __init__(self, gauges: list[QueueGauges]) -> None:
        self.gauges = gauges

    def collect(self) -> Iterator[Metric]:
        tasks = GaugeMetricFamily(
            "orbit_queue_tasks", "Unfinished tasks of the queue by state", labels=[*QUEUE_LABELS, "state"]
        )
        families = {
            "unfinished": GaugeMetricFamily(
                "orbit_queue_unfinished_tasks", "Unfinished tasks of the queue (every state)", labels=QUEUE_LABELS
            ),
            "active_permits": GaugeMetricFamily(
                "orbit_queue_active_permits", "Valid execution permits (LEASED + RUNNING attempts)", labels=QUEUE_LABELS
            ),
            "window_count": GaugeMetricFamily(
                "orbit_queue_start_window_count", "Starts approved in the current 1 s window", labels=QUEUE_LABELS
            ),
            "max_concurrency": GaugeMetricFamily(
                "orbit_queue_max_concurrency", "Configured permit limit", labels=QUEUE_LABELS
            ),
            "rate_per_second": GaugeMetricFamily(
                "orbit_queue_rate_per_second", "Configured starts per one-second window", labels=QUEUE_LABELS
            ),
            "paused": GaugeMetricFamily("orbit_queue_paused", "1 while the queue is paused", labels=QUEUE_LABELS),
        }
        for gauge in self.gauges:
            labels = list(gauge.labels)
            for state, value in (
                ("BLOCKED", gauge.blocked),
                ("WAITING", gauge.waiting),
                ("LEASED", gauge.leased),
                ("RUNNING", gauge.running),
                ("NEEDS_REVIEW", gauge.needs_review),
            ):
                tasks.add_metric([*labels, state], value)
            for field, family in families.items():
                family.add_metric(labels, float(getattr(gauge, field)))
        yield tasks
        yield from families.values()


def authorize_scrape(header: str | None) -> None:
    """The operator's token passes; anything else raises the error to answer.

    Metrics off (ORBIT_METRICS_TOKEN unset) is 404 for everyone: the endpoint
    is not there. A tenant's credential is 403 (it is a credential, not this
    one); any other token 401."""
    expected = settings.ORBIT_METRICS_TOKEN
    if not expected:
        raise NotFound("no such endpoint")
    token = token_from_header(header)
    # Constant time: the comparison must not reveal how much of a guess is right.
    if hmac.compare_digest(token.encode(), expected.encode()):
        return
    if TOKEN_PATTERN.match(token):
        authenticate_token(token)  # Unauthenticated unless it is a live credential
        raise PermissionDenied("metrics belong to the platform operator: use ORBIT_METRICS_TOKEN")
    raise Unauthenticated("invalid bearer token")


class MetricsView(APIView):
    """GET /metrics: the counters and every queue's gauges in Prometheus' text
    format, for the bearer of ORBIT_METRICS_TOKEN."""

    schema = None  # not part of the v1 API document
    # The token is checked here, not by the API's credential authentication.
    authentication_classes: list[type] = []
    permission_classes: list[type] = []

    def get(self, request: Request) -> HttpResponse:
        authorize_scrape(request.META.get("HTTP_AUTHORIZATION"))
        scrape = CollectorRegistry(auto_describe=False)
        scrape.register(metrics.AnsweringProcess())
        queues: list[QueueGauges] = []
        permits: dict[tuple[str, str, str, str], int] = {}
        up: dict[str, bool] = {}
        if not cells.configured():
            queues, permits = gauges()
        else:
            # Every cell's queues (labels name one queue installation-wide), read
            # at once; a cell that does not answer in time is left out, and said so.
            for cell, outcome in in_every_cell(gauges, CELL_SCRAPE_SECONDS).items():
                if isinstance(outcome, DatabaseError | Unavailable):
                    up[cell] = False
                elif isinstance(outcome, BaseException):
                    raise outcome
                else:
                    up[cell] = True
                    queues += outcome[0]
                    permits.update(outcome[1])
        scrape.register(QueueCollector(queues))
        scrape.register(KeyPermitCollector(permits))
        if up:
            scrape.register(CellCollector(up))
        return HttpResponse(generate_latest(counters()) + generate_latest(scrape), content_type=CONTENT_TYPE_LATEST)


def gauges() -> tuple[list[QueueGauges], dict[tuple[str, str, str, str], int]]:
    """Every queue's gauges and every key policy's permits (of the cell entered)."""
    return queue_gauges(), key_permit_gauges()


def counters() -> CollectorRegistry:
    """Where the counters are read from: this process's REGISTRY, or with several
    server processes every process's files (the REGISTRY then holds this one's
    alone, and its process_* and python_* figures would be one process's among N)."""
    directory = metrics.multiprocess_dir()
    if directory is None:
        return REGISTRY
    every_process = CollectorRegistry(auto_describe=False)
    MultiProcessCollector(every_process, path=directory)
    return every_process

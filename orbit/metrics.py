"""Prometheus counters, counted by the verbs.

Exposed at /metrics, with per-queue gauges, by console.metrics_view: the verbs
import this module, so it holds no HTTP and reads no table.

Under `orbit serve --processes N` the supervisor gives every child one fresh
directory in `MULTIPROCESS_DIR_ENV` (prometheus-client's multiprocess mode,
chosen by the client when it is imported): each process writes its counters to
files there, and a scrape answered by any of them adds up every process's,
the dead ones' too, so a counter never goes back when a child is restarted.
Without the variable (one process) they live in this process's REGISTRY."""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# prometheus-client's own name for it; server/supervisor.py sets it for its children.
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

TASKS_SUBMITTED = Counter("orbit_tasks_submitted_total", "Tasks accepted by submit")
ATTEMPTS_LEASED = Counter("orbit_attempts_leased_total", "Attempts created by dispatch")
ATTEMPTS_STARTED = Counter("orbit_attempts_started_total", "Starts approved")
ATTEMPTS_FINISHED = Counter("orbit_attempts_finished_total", "Attempts ended", ["state"])
LEASES_RECOVERED = Counter("orbit_leases_recovered_total", "Expired leases recovered")
# What a task costs in trips: worker-protocol frames each way, and the group
# commits (rounds) that decided them (bench/trips_per_task.py reads these).
FRAMES_RECEIVED = Counter("orbit_worker_frames_received_total", "Worker-protocol frames received")
FRAMES_SENT = Counter("orbit_worker_frames_sent_total", "Worker-protocol frames sent")
GROUPS_DECIDED = Counter(
    "orbit_groups_decided_total", "Group commits decided (rounds, in one transaction each)", ["lane"]
)


def multiprocess_dir() -> str | None:
    """Where every server process's counters are, when there are several."""
    return os.environ.get(MULTIPROCESS_DIR_ENV) or None


class AnsweringProcess(Collector):
    """orbit_server_process{pid}: which process answered the scrape, read when
    it is answered. Not a multiprocess gauge: the client would add a pid label
    of its own to every process's value, and the question is who answered."""

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "orbit_server_process", "The server process that answered this scrape (1)", labels=["pid"]
        )
        family.add_metric([str(os.getpid())], 1)
        yield family


_finished_by_state: dict[str, Counter] = {}


def count_finished_attempt(state: str) -> None:
    """ATTEMPTS_FINISHED for one attempt, its labelled child looked up once per
    state (labels() validates and locks on every call, per attempt, on the round thread)."""
    child = _finished_by_state.get(state)
    if child is None:
        child = _finished_by_state[state] = ATTEMPTS_FINISHED.labels(state=state)
    child.inc()

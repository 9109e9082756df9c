"""Prometheus counters of this process, counted by the verbs.

Exposed at /metrics, with per-queue gauges, by console.metrics_view: the verbs
import this module, so it holds no HTTP and reads no table."""

from __future__ import annotations

import os

from prometheus_client import Counter, Gauge

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

# Every figure here is this process's: under `orbit serve --processes N` a
# scrape is answered by one of the N, and this says which.
SERVER_PROCESS = Gauge("orbit_server_process", "The server process that answered this scrape (1)", ["pid"])
SERVER_PROCESS.labels(pid=str(os.getpid())).set(1)

_finished_by_state: dict[str, Counter] = {}


def count_finished_attempt(state: str) -> None:
    """ATTEMPTS_FINISHED for one attempt, its labelled child looked up once per
    state (labels() validates and locks on every call, per attempt, on the round thread)."""
    child = _finished_by_state.get(state)
    if child is None:
        child = _finished_by_state[state] = ATTEMPTS_FINISHED.labels(state=state)
    child.inc()

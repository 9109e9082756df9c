"""System modules for bench/run_all.py — the contract.

A *system* is one queue under test. Each is reachable through ``REGISTRY`` below as
``"module"`` (the module itself is the system) or ``"module:ATTR"`` (an object in the
module, for one module that runs several systems, e.g. Celery on two brokers). Either way
the system exposes:

``NAME: str``
    Short name used in results ("orbit", "celery-rabbitmq", ...).
``DURABILITY: str``
    One sentence: what is on disk when a submit returns, and what a crash loses.
``WORKLOADS: tuple[str, ...]``
    The subset of ``ALL_WORKLOADS`` it implements. Anything else is reported "n/a".
``run(workload: str, scale: dict) -> dict``
    Runs one repetition of one workload and returns flat metrics (below).
``NOTES: dict[str, str]`` (optional)
    Per workload: why it is n/a, or what differs in semantics (shown in results.md).
``CONFIG: dict`` (optional)
    Worker counts, concurrency, timeouts, versions: recorded verbatim in results.json.

Rules for ``run``:
- run_all.py calls it in a fresh child process (``bench/.venv/bin/python -m
  bench.run_all``), once per repetition, with ``cwd`` = the repository root, which ``-m``
  puts on the import path (so ``from bench import common`` and ``bench.systems.x`` work).
  A process it starts runs from the root too, as ``python -m bench.systems.x`` (or the
  peer's own ``-m`` entry point naming ``bench.systems.x``). Orbit's own code is reached
  only through subprocesses started with ``common.ORBIT_PYTHON``.
- It starts and stops everything it starts (servers, worker processes), using
  ``common.spawn`` / ``common.stop_process`` so run_all.py's safety net can end leftovers
  by pid; it never stops or reconfigures the shared services (MariaDB, PostgreSQL, Redis,
  RabbitMQ) and cleans up what it created in them (databases, queues).
- It is bounded in time: it must return (or raise) before ``scale["deadline_s"]``
  seconds; run_all.py kills the child process group after ``deadline_s + 60``.
- It raises on failure (the run is recorded as an error, not as a number).

``scale`` keys (FULL / QUICK in run_all.py):
    mode ("full"/"quick"), run (0-based repetition), tasks (W1/W2 task count),
    workers, capacity, submitters (Orbit's 4 x 32 and 16 concurrent HTTP submitters),
    keys (W2 key counts, e.g. [1, 10, 100]), rate, rate_seconds (W3), lease_seconds,
    crash_tasks (W4), backlog_small, backlog_large, lease_samples (W5), w0_seconds (W0),
    deadline_s.

Metric keys (missing or ``None`` = not measured; use the names below where they apply,
add workload-specific ones freely; numbers, booleans or short strings only; a nested
``"config"`` or ``"notes"`` value is kept verbatim and not aggregated):

W0 ceiling     commits_per_s (raw MariaDB, per transaction shape: commits_per_s_<shape>),
               transactions_per_task, ceiling_tasks_per_s; for the grouped shapes
               transactions_per_task_grouped, ceiling_tasks_per_s_grouped
W1 throughput  tasks, seconds, tasks_per_s, submit_per_s,
               latency_p50_ms, latency_p95_ms, latency_p99_ms   (submit -> start)
               server_cpu_s_per_1k, db_cpu_s_per_1k, client_cpu_s_per_1k,
               machine_cpu_s_per_1k, machine_busy_pct, cpu_bound_tasks_per_s
               (every process on the machine: the rate at which the run's CPU per
               task would keep every core busy)
               drain_tasks, drain_seconds, drain_tasks_per_s    (pre-loaded backlog)
W2 keyed       tasks_per_s_keys1, tasks_per_s_keys10, tasks_per_s_keys100 (one per
               scale["keys"] entry), overlap_ok (bool), overlaps (count),
               tokens_increasing (bool, where the system has fencing tokens)
W3 rate        target_rate, achieved_rate, worst_window (most starts in any sliding 1 s),
               min_window (fewest in a fixed 1 s window), windows_over_limit
W4 crash       held_total, held_running, first_rerun_s, relapse_s (kill -> last held task
               running elsewhere; Orbit: kill -> last held attempt re-leased), lost,
               duplicates (tasks completed twice), extra_executions,
               stale_writes_rejected (tokens; None where the system has none)
W5 backlog     backlog_small, backlog_large, lease_p50_ms_1k, lease_p99_ms_1k,
               lease_p50_ms_1m, lease_p99_ms_1m ("1k" = backlog_small, "1m" =
               backlog_large, whatever the actual sizes; --quick uses 1,000 vs 20,000)

``common.py`` has the shared helpers: ``CpuMeter`` (server/db/client CPU seconds from
/proc), ``latency_metrics``, ``rate_metrics``, ``overlap_check``, ``crash_metrics``,
``spawn``/``stop_process``/``kill9``, ``EventLog``/``log_event``, fresh databases.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

ALL_WORKLOADS = ("W0", "W1", "W2", "W3", "W4", "W5", "W6")

WORKLOAD_TITLES = {
    "W0": "ceiling: raw MariaDB commits/s for Orbit's transaction shapes",
    "W1": "no-op throughput: submit one by one then complete; drain of a pre-loaded backlog",
    "W2": "keyed contention: tasks over 1, 10 and 100 keys; overlap check",
    "W3": "rate accuracy: one queue at 50 starts/s under more demand",
    "W4": "crash recovery: kill -9 a worker holding tasks",
    "W5": "backlog scale: lease/fetch latency with a small vs a large waiting backlog",
    "W6": "key start rate: unkeyed throughput beside one rate-limited key in the same queue; the key's rate",
}

# name -> "module" or "module:ATTR" (inside bench/systems/); run order = this order
REGISTRY: dict[str, str] = {
    "orbit": "orbit_system",
    "celery-rabbitmq": "celery_system:RABBITMQ",
    "celery-redis": "celery_system:REDIS",
    "procrastinate": "procrastinate_system",
    "django-q2": "django_orm_system",
}

# shared services each system needs (run_all.py checks them before running it)
REQUIRES: dict[str, tuple[str, ...]] = {
    "orbit": ("mariadb",),
    "celery-rabbitmq": ("rabbitmq",),
    "celery-redis": ("redis",),
    "procrastinate": ("postgres",),
    "django-q2": ("mariadb",),
}


def load(name: str) -> Any:
    """The system object (module or attribute) registered under ``name``."""
    target = REGISTRY[name]
    module_name, _, attr = target.partition(":")
    module: ModuleType = importlib.import_module(f"bench.systems.{module_name}")
    system = getattr(module, attr) if attr else module
    for required in ("NAME", "DURABILITY", "WORKLOADS", "run"):
        if not hasattr(system, required):
            raise TypeError(f"system {name!r} ({target}) lacks {required}")
    return system

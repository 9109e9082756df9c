"""Workload drivers shared by the peer systems (Celery, Procrastinate, django-q2).

A peer supplies an adapter (subclass of ``Peer``) that knows how to start one worker
node, submit tasks one by one, confirm completion on the system's side, and (for W5)
pre-load a backlog and time one fetch. The drivers here turn that into W1, W2, W4 and W5
runs with the same timing rules for every peer:

- every task body writes ``S`` (started) and ``D`` (finished) lines to the event log
  (``common.log_event``) with the wall clock; submit times are taken just before the
  submit call, like Orbit's bench takes them before the HTTP POST;
- a phase ends when every task has its ``D`` line *and* the system says it is done
  (job row marked succeeded / queue row acknowledged), polled every 10 ms;
- task keys are ``<phase>-<n>``; W2 puts the per-key mutex name in the task arguments.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from bench.common import (
    CpuMeter,
    EventLog,
    crash_metrics,
    kill9,
    latency_metrics,
    now,
    overlap_check,
    stop_process,
    wait_until,
    work_dir,
)

Item = tuple[str, dict[str, Any]]  # (task key, options: kind = noop|hold|rated, lock = str)


class Peer:
    """Adapter interface. Override what the peer supports."""

    NAME = "peer"
    DURABILITY = ""
    WORKLOADS: tuple[str, ...] = ()
    NOTES: dict[str, str] = {}
    CONFIG: dict[str, Any] = {}
    SERVICES: tuple[str, ...] = ()  # keys of common.SERVICES whose CPU counts as "db"
    READY_TIMEOUT = 60.0
    W2_NODE_OPTIONS: dict[str, Any] = {}  # extra start_node options for W2 workers

    # --- lifecycle of one run
    def setup(self, scale: dict) -> None:
        """Fresh database / queue names for this run."""

    def teardown(self) -> None:
        """Drop what setup created. Must not raise."""

    # --- workers
    def start_node(self, role: str, index: int, events: EventLog, **options: Any) -> subprocess.Popen:
        raise NotImplementedError

    def node_ready(self, proc: subprocess.Popen, events: EventLog) -> bool:
        """Default: the node wrote an ``R`` line from its main process."""
        return proc.pid in events.ready

    # --- submission
    def submit_all(self, items: list[Item], concurrency: int) -> dict[str, float]:
        """Submit one by one with ``concurrency`` concurrent submitters; return key -> wall
        time taken just before that task's submit call."""
        raise NotImplementedError

    def confirm_done(self, prefix: str, count: int) -> bool:
        """System-side check that ``count`` tasks of phase ``prefix`` are finished
        (acknowledged / marked succeeded). Default: the event log is all we have."""
        return True

    def clear_phase(self, prefix: str) -> None:
        """Remove what is left of a phase that timed out (W2), so the next starts clean."""

    # --- W5
    def preload_bulk(self, count: int) -> None:
        raise NotImplementedError

    def fetch_once(self) -> None:
        """Take the next job the way a worker does, once (timed by the driver)."""
        raise NotImplementedError

    def clear_backlog(self) -> None:
        raise NotImplementedError

    # --- dispatch
    def run(self, workload: str, scale: dict) -> dict:
        if workload not in self.WORKLOADS:
            raise ValueError(f"{self.NAME} does not implement {workload}")
        custom = getattr(self, f"run_{workload.lower()}", None)
        if custom is not None:
            return custom(scale)
        return {"W1": run_w1, "W2": run_w2, "W4": run_w4, "W5": run_w5}[workload](self, scale)


# ---------------------------------------------------------------------------- helpers


def threaded_submit(
    submit_one: Callable[[str, dict[str, Any]], None],
    items: list[Item],
    concurrency: int,
    thread_setup: Callable[[], Any] | None = None,
    thread_teardown: Callable[[], Any] | None = None,
) -> dict[str, float]:
    """Run ``submit_one(key, options)`` for every item from ``concurrency`` threads."""
    source = iter(items)
    lock = threading.Lock()
    submitted: dict[str, float] = {}
    errors: list[BaseException] = []

    def worker() -> None:
        if thread_setup:
            thread_setup()
        try:
            while not errors:
                with lock:
                    item = next(source, None)
                if item is None:
                    return
                key, options = item
                at = now()
                submit_one(key, options)
                submitted[key] = at
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            if thread_teardown:
                thread_teardown()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return submitted


def start_nodes(peer: Peer, events: EventLog, count: int, role: str, deadline: float, **options: Any) -> list:
    procs = [peer.start_node(role, i, events, **options) for i in range(count)]
    wait_ready(peer, events, procs, deadline)
    return procs


def wait_ready(peer: Peer, events: EventLog, procs: list, deadline: float) -> None:
    limit = min(peer.READY_TIMEOUT, max(1.0, deadline - time.monotonic()))

    def ready() -> bool:
        events.poll()
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{peer.NAME}: worker exited with {p.returncode} during start-up")
        return all(peer.node_ready(p, events) for p in procs)

    if not wait_until(ready, limit, 0.1):
        raise TimeoutError(f"{peer.NAME}: workers not ready after {limit:.0f}s")


def stop_nodes(procs: Iterable[subprocess.Popen]) -> None:
    procs = list(procs)
    threads = [threading.Thread(target=stop_process, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def wait_done(peer: Peer, events: EventLog, prefix: str, count: int, deadline: float) -> float | None:
    """Wait until ``count`` distinct tasks of ``prefix`` finished in the event log and the
    system confirms; return the completion time (wall clock) or None on deadline."""
    while time.monotonic() < deadline:
        events.poll()
        if events.done_by_prefix(prefix) >= count:
            break
        time.sleep(0.02)
    else:
        return None
    if type(peer).confirm_done is Peer.confirm_done:
        return events.last_done(prefix)
    while time.monotonic() < deadline:
        if peer.confirm_done(prefix, count):
            return max(events.last_done(prefix), now())
        time.sleep(0.01)
    return None


def warm_up(peer: Peer, events: EventLog, count: int, deadline: float) -> None:
    """A few tasks through the running nodes so connections and imports are warm."""
    items = [(f"warm-{i}", {"kind": "noop"}) for i in range(count)]
    peer.submit_all(items, min(count, 8))
    if wait_done(peer, events, "warm", count, deadline) is None:
        raise TimeoutError(f"{peer.NAME}: warm-up tasks did not complete")


def deadline_from(scale: dict) -> float:
    return time.monotonic() + float(scale.get("deadline_s", 600)) - 5.0


# ---------------------------------------------------------------------------- W1


def run_w1(peer: Peer, scale: dict) -> dict:
    """Submit ``tasks`` one by one (``submitters`` concurrent submitters) to running
    workers and wait for all to complete; then stop the workers, pre-load the same number,
    start the workers and time the drain (first start -> last completion)."""
    deadline = deadline_from(scale)
    n = int(scale["tasks"])
    nodes = int(scale["workers"])
    events = EventLog(work_dir(f"{peer.NAME}-w1"))
    procs: list = []
    result: dict[str, Any] = {}
    peer.setup(scale)
    try:
        procs = start_nodes(peer, events, nodes, "w", deadline)
        warm_up(peer, events, nodes * 2, deadline)

        items = [(f"a-{i}", {"kind": "noop"}) for i in range(n)]
        meter = CpuMeter(lambda: [p.pid for p in procs], peer.SERVICES).start()
        t0 = now()
        submitted = peer.submit_all(items, int(scale["submitters"]))
        t_submitted = now()
        t_end = wait_done(peer, events, "a", n, deadline)
        meter.stop()
        if t_end is None:
            raise TimeoutError(f"{peer.NAME} W1: {events.done_by_prefix('a')}/{n} done before the deadline")
        latencies = [events.starts[k][0][0] - t for k, t in submitted.items() if k in events.starts]
        result.update(
            tasks=n,
            seconds=round(t_end - t0, 3),
            tasks_per_s=round(n / (t_end - t0), 1),
            submit_per_s=round(n / (t_submitted - t0), 1),
            **latency_metrics(latencies),
            **meter.per_1k(n),
        )
        stop_nodes(procs)
        procs = []

        # drain of a pre-loaded backlog
        peer.submit_all([(f"d-{i}", {"kind": "noop"}) for i in range(n)], int(scale["submitters"]))
        procs = [peer.start_node("w", i, events) for i in range(nodes)]
        t_end = wait_done(peer, events, "d", n, deadline)
        if t_end is None:
            raise TimeoutError(f"{peer.NAME} W1 drain: {events.done_by_prefix('d')}/{n} done")
        first = min(events.starts[f"d-{i}"][0][0] for i in range(n))
        result.update(
            drain_tasks=n,
            drain_seconds=round(t_end - first, 3),
            drain_tasks_per_s=round(n / (t_end - first), 1),
        )
        return result
    finally:
        stop_nodes(procs)
        peer.teardown()


# ---------------------------------------------------------------------------- W2


def run_w2(peer: Peer, scale: dict) -> dict:
    """Per key count K: pre-load ``tasks`` tasks, task i holding the mutex
    ``object/{i % K}`` (submitted one by one, untimed), start the workers and time the
    drain from the first start to the last completion; then check from the event log
    that no two executions of one key overlapped. Workers are restarted per K."""
    deadline = deadline_from(scale)
    n = int(scale["tasks"])
    key_counts = list(scale.get("keys", [1, 10, 100]))
    events = EventLog(work_dir(f"{peer.NAME}-w2"))
    procs: list = []
    result: dict[str, Any] = {"tasks": n}
    all_executions: list[tuple[str, float, float]] = []
    peer.setup(scale)
    try:
        for index, k in enumerate(key_counts):
            # share what is left fairly between the remaining key counts
            left = deadline - time.monotonic()
            phase_deadline = time.monotonic() + left / (len(key_counts) - index)
            prefix = f"keys{k}"
            items = [(f"{prefix}-{i}", {"kind": "noop", "lock": f"object/{i % k}"}) for i in range(n)]
            peer.submit_all(items, int(scale["submitters"]))
            procs = [peer.start_node("w", i, events, **peer.W2_NODE_OPTIONS) for i in range(int(scale["workers"]))]
            t_end = wait_done(peer, events, prefix, n, phase_deadline)
            done = events.done_by_prefix(prefix)
            timed_out = t_end is None
            if t_end is None:
                t_end = now()
                result[f"timed_out_keys{k}"] = True
                result[f"done_keys{k}"] = done
            stop_nodes(procs)
            procs = []
            events.poll()
            firsts = [runs[0][0] for key, runs in events.starts.items() if key.startswith(prefix + "-")]
            if firsts:
                result[f"tasks_per_s_keys{k}"] = round(done / (t_end - min(firsts)), 1)
            for i in range(n):
                key = f"{prefix}-{i}"
                starts, ends = events.starts.get(key, []), events.dones.get(key, [])
                for (start, _, _), (end, _, _) in zip(starts, ends, strict=False):
                    all_executions.append((f"object/{i % k}", start, end))
            if timed_out:
                peer.clear_phase(prefix)
        ok, overlaps = overlap_check(all_executions)
        result.update(overlap_ok=ok, overlaps=overlaps, executions_checked=len(all_executions))
        return result
    finally:
        stop_nodes(procs)
        peer.teardown()


# ---------------------------------------------------------------------------- W4


def run_w4(peer: Peer, scale: dict) -> dict:
    """A victim node takes ``crash_tasks`` tasks whose body sleeps (only on the victim);
    a survivor node starts; the victim's whole process group gets SIGKILL; measure when
    the tasks it held run on the survivor, duplicates and losses."""
    deadline = deadline_from(scale)
    count = int(scale["crash_tasks"])
    lease = float(scale["lease_seconds"])
    events = EventLog(work_dir(f"{peer.NAME}-w4"))
    victim = survivor = None
    peer.setup(scale)
    try:
        victim = peer.start_node("victim", 0, events)
        wait_ready(peer, events, [victim], deadline)
        keys = [f"crash-{i}" for i in range(count)]
        peer.submit_all([(k, {"kind": "hold"}) for k in keys], 4)

        # wait until the victim has taken what it will take (no new start for 1 s)
        seen, stable_since = -1, time.monotonic()
        limit = time.monotonic() + 30
        while time.monotonic() < limit:
            events.poll()
            started = events.started_by_prefix("crash")
            if started != seen:
                seen, stable_since = started, time.monotonic()
            elif started > 0 and time.monotonic() - stable_since >= 1.0:
                break
            time.sleep(0.05)
        if seen <= 0:
            raise RuntimeError(f"{peer.NAME} W4: the victim started no task")

        survivor = peer.start_node("survivor", 1, events)
        wait_ready(peer, events, [survivor], deadline)
        time.sleep(0.5)
        events.poll()
        t_kill = now()
        kill9(victim)
        bound = min(deadline, time.monotonic() + lease * 4 + 60)
        t_end = wait_done(peer, events, "crash", count, bound)
        events.poll()
        metrics = crash_metrics(events, keys, t_kill)
        metrics["all_completed"] = t_end is not None
        metrics["lease_seconds"] = lease
        return metrics
    finally:
        stop_nodes([p for p in (victim, survivor) if p is not None])
        peer.teardown()


# ---------------------------------------------------------------------------- W5


def run_w5(peer: Peer, scale: dict) -> dict:
    """Fetch latency (one worker's 'take the next job' call, timed in the harness) with a
    small and a large waiting backlog; no workers run."""
    samples = int(scale.get("lease_samples", 200))
    result: dict[str, Any] = {}
    peer.setup(scale)
    try:
        for size, label in ((int(scale["backlog_small"]), "1k"), (int(scale["backlog_large"]), "1m")):
            began = time.monotonic()
            peer.preload_bulk(size)
            result[f"preload_s_{label}"] = round(time.monotonic() - began, 1)
            for _ in range(5):  # warm connection and caches
                peer.fetch_once()
            timings = []
            for _ in range(samples):
                t = time.perf_counter()
                peer.fetch_once()
                timings.append(time.perf_counter() - t)
            result.update(latency_metrics(timings, f"lease_{label}_tmp"))
            result[f"lease_p50_ms_{label}"] = result.pop(f"lease_{label}_tmp_p50_ms")
            result[f"lease_p95_ms_{label}"] = result.pop(f"lease_{label}_tmp_p95_ms")
            result[f"lease_p99_ms_{label}"] = result.pop(f"lease_{label}_tmp_p99_ms")
            peer.clear_backlog()
        result["backlog_small"] = int(scale["backlog_small"])
        result["backlog_large"] = int(scale["backlog_large"])
        result["lease_samples"] = samples
        if result.get("lease_p50_ms_1k"):
            result["lease_p50_ratio_1m_vs_1k"] = round(result["lease_p50_ms_1m"] / result["lease_p50_ms_1k"], 2)
        return result
    finally:
        peer.teardown()

"""Orbit's server memory over a long run (issue 5: "memory flat").

Starts an Orbit server (python -m orbit.serve) on a fresh MariaDB database and 4 SDK workers
(capacity 32), keeps a backlog of about --backlog tasks topped up with
POST /v1/tasks:batch (--single: single POST /v1/tasks from 16 concurrent
submitters) until --tasks have been submitted, and samples the
server's resident memory (VmRSS) once a second until every task is done.
Prints RSS at each tenth of the run and the drift from the first tenth.

    bench/.venv/bin/python -m bench.systems.orbit_memory --tasks 100000
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from bench import common
from bench.systems.orbit_system import Server, stop_all, submit_one_by_one, task_body, wait_ready

BATCH = 500
PREFIX = "m"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def run(total: int, backlog: int, single: bool) -> None:
    server = Server(f"bench_orbit_memory_{int(time.time())}")
    procs = []
    try:
        queue_id = await server.create_queue("memory")
        events = common.EventLog(common.work_dir(f"orbit-memory-{time.time_ns()}"))
        procs = server.workers([queue_id], 4, 32, events)
        wait_ready(events, 4, time.monotonic() + 60)
        submitted = 0
        samples: list[tuple[float, int, float]] = []  # (seconds, done, rss MiB)
        began = time.monotonic()
        next_sample = began
        next_report = 0
        while True:
            done = events.poll().done_by_prefix(PREFIX)
            now = time.monotonic()
            if now >= next_sample:  # between submissions too: single submits keep the loop busy
                samples.append((now - began, done, rss_mib(server.proc.pid)))
                next_sample = now + 1.0
                if done >= next_report:  # progress, so a run cut short still tells
                    print(f"progress {done:>9,} done {samples[-1][2]:8.1f} MiB {now - began:6.0f} s", flush=True)
                    next_report += max(total // 20, 1)
            if done >= total:
                break
            if submitted < total and submitted - done < backlog:
                labels = [f"{PREFIX}-{n}" for n in range(submitted, min(submitted + BATCH, total))]
                if single:
                    await asyncio.to_thread(submit_one_by_one, server, queue_id, labels, 16)
                else:
                    items = [{"idempotency_key": label, "task": task_body(queue_id, label)} for label in labels]
                    response = await server.http.post("/v1/tasks:batch", json={"tasks": items})
                    response.raise_for_status()
                submitted += len(labels)
                continue
            await asyncio.sleep(0.05)
        seconds = time.monotonic() - began
        print(f"{total} tasks in {seconds:.0f} s ({total / seconds:.0f} tasks/s), backlog kept near {backlog}")
        print("done      RSS MiB")
        marks = [total * tenth // 10 for tenth in range(1, 11)]
        shown = []
        for mark in marks:
            sample = next((s for s in samples if s[1] >= mark), samples[-1])
            shown.append(sample)
            print(f"{sample[1]:>9,} {sample[2]:8.1f}")
        peak = max(sample[2] for sample in samples)
        print(f"RSS first tenth -> end: {shown[0][2]:.1f} -> {shown[-1][2]:.1f} MiB; peak {peak:.1f}")
    finally:
        stop_all(procs)
        await server.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--backlog", type=int, default=5_000)
    parser.add_argument("--single", action="store_true", help="submit one task per request")
    args = parser.parse_args()
    asyncio.run(run(args.tasks, args.backlog, args.single))


if __name__ == "__main__":
    main()

"""The SDK worker's own CPU per task, two SDK checkouts interleaved.

Starts the harness's Orbit server (bench/systems/orbit_system.py) on a fresh
MariaDB database and, for each run, preloads a backlog of no-op tasks on a
queue of its own and drains it with one SDK worker process (capacity 32) that
counts its handler's calls and, when the backlog is done, prints the CPU its
process spent (user + system, `resource.getrusage`) from its first
assignment. The runs alternate between the SDKs given (A B A B ...), so the
machine's drift falls on both alike:

    .venv/bin/python -m bench.worker_cpu --tasks 5000 --runs 6
    .venv/bin/python -m bench.worker_cpu --sdk /tmp/before/sdk --sdk sdk --runs 8

A worker can also write a cProfile of its event loop (`--profile FILE`).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.systems import orbit_system


def process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def drain(url: str, token: str, queue_id: str, tasks: int, capacity: int, profile: str | None) -> dict[str, Any]:
    """One worker's drain of `tasks` no-op tasks; what its process spent from the first assignment."""
    from orbit_sdk import Worker  # the SDK on this process's path: the one under test

    handled = 0
    began: list[float] = []
    all_done = asyncio.Event()

    async def noop(execution: Any) -> None:
        nonlocal handled
        if not began:
            began.extend((time.monotonic(), process_cpu_seconds()))
        handled += 1
        if handled == tasks:
            all_done.set()

    worker = Worker(url, token, queues=[queue_id], handlers={"noop": noop}, capacity=capacity, worker_id="cpu")
    profiler = cProfile.Profile() if profile else None

    async def until_done() -> None:
        running = asyncio.ensure_future(worker.run_async())
        await all_done.wait()
        running.cancel()

    if profiler:
        profiler.enable()
    try:
        asyncio.run(until_done())
    except asyncio.CancelledError:
        pass
    finished = (time.monotonic(), process_cpu_seconds())
    if profiler and profile:
        profiler.disable()
        profiler.dump_stats(profile)
    return {
        "tasks": tasks,
        "seconds": round(finished[0] - began[0], 3),
        "worker_cpu_ms_per_task": round(1000 * (finished[1] - began[1]) / tasks, 4),
    }


async def compare(sdks: list[str], args: argparse.Namespace) -> dict[str, list[float]]:
    """Each run's backlog drained by a worker of the next SDK in turn: its CPU a task, by SDK."""
    server = orbit_system.Server("worker_cpu")
    figures: dict[str, list[float]] = {sdk: [] for sdk in sdks}
    try:
        for run in range(args.runs):
            sdk = sdks[run % len(sdks)]
            queue_id = await server.create_queue(f"worker-cpu-{run}")
            await server.preload(queue_id, [f"r{run}-{n}" for n in range(args.tasks)])
            argv = [sys.executable, "-m", "bench.worker_cpu", "--tasks", str(args.tasks)]
            argv += ["--capacity", str(args.capacity), "--worker", server.url, server.token, queue_id]
            if args.profile and run == 0:
                argv += ["--profile", args.profile]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([sdk, str(common.ROOT)])}
            done = await asyncio.to_thread(
                subprocess.run, argv, env=env, cwd=common.ROOT, check=True, capture_output=True, text=True
            )
            result = json.loads(done.stdout.strip().splitlines()[-1])
            figures[sdk].append(result["worker_cpu_ms_per_task"])
            print(f"run {run + 1} {sdk}: {result}", flush=True)
    finally:
        await server.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=4, help="runs in all, alternating between the SDKs given")
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--sdk", action="append", help="an SDK directory (holding orbit_sdk/); default: this one's")
    parser.add_argument("--profile", help="a cProfile of the (first) worker's event loop, written to this file")
    parser.add_argument("--worker", nargs=3, metavar=("URL", "TOKEN", "QUEUE_ID"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(drain(*args.worker, args.tasks, args.capacity, args.profile)))
        return
    sdks = [str(Path(path).resolve()) for path in (args.sdk or [common.ROOT / "sdk"])]
    figures = asyncio.run(compare(sdks, args))
    for sdk, values in figures.items():
        print(f"{sdk}: worker CPU ms a task, median {statistics.median(values):.4f} of {values}")
    if len(sdks) == 2:
        ratios = [b / a for a, b in zip(figures[sdks[0]], figures[sdks[1]], strict=False)]
        print(f"{sdks[1]} / {sdks[0]}, run by run: {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()

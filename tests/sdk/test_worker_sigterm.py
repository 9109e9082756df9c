"""A worker process (Worker.run() on the main thread) against the real server, stopped
with SIGTERM while handlers run: they finish and report, nothing else is taken, the process
exits 0, and the tasks it never started are still there for the next worker."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import pytest

import orbit_sdk
from orbit_sdk import Client, SubmitTaskRequest

pytestmark = pytest.mark.django_db(transaction=True)

PROGRAM = textwrap.dedent(
    """
    import sys, threading, time
    import orbit_sdk

    # Two handlers start at once on two threads: print() writes a line in parts,
    # so without the lock their lines interleaved.
    printing = threading.Lock()

    def say(*words):
        with printing:
            print(*words, flush=True)

    def slow(execution):
        say("started", execution.task.id)
        time.sleep(2)
        return {"n": execution.payload["n"]}

    worker = orbit_sdk.Worker(sys.argv[1], sys.argv[2], [sys.argv[3]], {("slow", "v1"): slow}, capacity=2)
    worker.run()
    print("stopped", flush=True)
    """
)


def test_sigterm_lets_running_handlers_finish_and_leaves_the_rest_waiting(orbit_server: Any, tenant: Any) -> None:
    with Client(orbit_server.url, tenant.token) as client:
        name = f"audit-{uuid.uuid4().hex[:10]}"
        queue_id = client.create_queue(
            f"q-{name}", orbit_sdk.CreateQueueRequest(name=name, max_concurrency=8, rate_per_second=1000)
        ).queue.id
        tasks = [
            client.submit_task(f"{name}-{n}", SubmitTaskRequest(queue_id, "slow", "v1", "v1", {"n": n})).task
            for n in range(5)
        ]
        process = subprocess.Popen(
            [sys.executable, "-c", PROGRAM, orbit_server.url, tenant.token, queue_id],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert process.stdout is not None
            lines = [process.stdout.readline() for _ in range(2)]
            if not all(line.startswith("started ") for line in lines):
                process.kill()
                _, err = process.communicate(timeout=20)
                pytest.fail(f"the worker did not say it started two handlers: {lines}\n{err[-4000:]}")
            started = {line.split()[1] for line in lines}
            process.send_signal(signal.SIGTERM)
            out, err = process.communicate(timeout=20)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.returncode == 0, err
        assert out.splitlines() == ["stopped"], (out, err)
        time.sleep(0.5)
        states = {task.id: client.get_task(task.id) for task in tasks}
        for task_id in started:
            assert states[task_id].state == "SUCCEEDED" and states[task_id].attempts == 1
        rest = [task for task_id, task in states.items() if task_id not in started]
        assert [(task.state, task.attempts) for task in rest] == [("WAITING", 0)] * 3, [
            (task.state, task.attempts, task.last_error) for task in rest
        ]

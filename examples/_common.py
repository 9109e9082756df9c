"""Shared plumbing for the examples: credentials, a hard deadline, a worker thread."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from orbit_sdk import Client, Worker, load_credentials

DEADLINE_SECONDS = 20.0


def client_from_env() -> tuple[Client, str, str]:
    credentials = load_credentials(os.environ.get("ORBIT_CREDENTIALS_FILE"))
    url = os.environ.get("ORBIT_URL") or credentials.url
    return Client(url, credentials.token), url, credentials.token


def arm_deadline(seconds: float = DEADLINE_SECONDS) -> float:
    """Exits the process non-zero if the example is still running after `seconds`."""
    deadline = time.monotonic() + seconds

    def expire() -> None:
        print(f"example: deadline of {seconds:.0f} s passed", file=sys.stderr, flush=True)
        os._exit(2)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return deadline


def start_worker(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, name=f"worker-{worker.worker_id}", daemon=True)
    thread.start()
    return thread


def wait_for(condition: Callable[[], bool], deadline: float, what: str) -> None:
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"example: timed out waiting for {what}")
        time.sleep(0.1)

"""The demo worker `scripts/run` starts: serves the bootstrap queue with an
`echo` handler and submits one task so there is something to see."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples._common import start_worker  # noqa: E402
from orbit_sdk import Client, SubmitTaskRequest, Worker  # noqa: E402


def echo(execution):
    return {"echo": execution.payload, "attempt": execution.attempt_number}


def main() -> None:
    credentials = json.loads(Path(os.environ["ORBIT_CREDENTIALS_FILE"]).read_text())
    url = os.environ.get("ORBIT_URL") or credentials["url"]
    queue_id = credentials["queue_id"]
    worker = Worker(url, credentials["token"], queues=[queue_id], handlers={("echo", "v1"): echo}, capacity=4)
    thread = start_worker(worker)
    with Client(url, credentials["token"]) as client:
        task = client.submit_task(
            f"demo-{uuid.uuid4().hex}",
            SubmitTaskRequest(
                queue_id=queue_id,
                handler="echo",
                handler_version="v1",
                payload_version="v1",
                payload={"hello": "orbit"},
            ),
        ).task
        for _ in range(100):
            current = client.get_task(task.id)
            if current.state not in ("WAITING", "LEASED", "RUNNING"):
                break
            time.sleep(0.1)
        print(f"demo worker: task {current.id} {current.state} output={json.dumps(current.output)}", flush=True)
    thread.join()


if __name__ == "__main__":
    main()

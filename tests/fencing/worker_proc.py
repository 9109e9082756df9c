"""A real orbit_sdk.Worker process for the live fencing test: `python -m tests.fencing.worker_proc SPEC.json`.

Each handler announces it is running (so the test can SIGSTOP this process mid-handler), waits
for the test's go, then makes its write through two guards on two resource databases: one
checking the token only, one checking the lease too. It records what each guard answered.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import orbit_sdk
from orbit_sdk import fencing


def slug(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def guarded_writes(execution: orbit_sdk.Execution, resources: dict[str, str], writer: str) -> dict[str, str]:
    """The write, through the token-only guard and through the lease-checking guard."""
    answers = {}
    for name, path in resources.items():
        conn = sqlite3.connect(path, timeout=30)
        try:
            fence = fencing.Guard(conn).for_execution(execution, check_lease=name == "lease")

            def write(connection: Any) -> dict[str, str]:
                connection.execute(
                    "INSERT INTO writes (fence_key, token, writer) VALUES (?, ?, ?)",
                    (execution.concurrency_key, execution.concurrency_token, writer),
                )
                return {"writer": writer}

            fence.write(f"write-{execution.attempt_id}", write)
            answers[name] = "landed"
        except fencing.StaleToken:
            answers[name] = "stale_token"
        except fencing.LeaseExpired:
            answers[name] = "lease_expired"
        finally:
            conn.close()
    return answers


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    markers = Path(spec["markers"])

    def handler(execution: orbit_sdk.Execution) -> dict[str, Any]:
        key = execution.concurrency_key
        assert key is not None
        (markers / f"started-{slug(key)}").write_text(str(execution.concurrency_token))
        while not (markers / "go").exists():  # the test SIGSTOPs this process meanwhile
            time.sleep(0.02)
        answers = guarded_writes(execution, spec["resources"], "paused")
        outcome = {"key": key, "token": execution.concurrency_token, **answers}
        (markers / f"done-{slug(key)}").write_text(json.dumps(outcome))
        return outcome

    worker = orbit_sdk.Worker(
        spec["url"],
        spec["token"],
        [spec["queue_id"]],
        {("fence.write", "v1"): handler},
        capacity=spec["capacity"],
        namespace_id=spec["namespace_id"],
    )
    worker.run()


if __name__ == "__main__":
    main()

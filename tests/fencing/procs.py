"""Child processes of the fencing tests: `python -m tests.fencing.procs SPEC.json`.

A separate interpreter per writer, so the guard is tested across processes (as the seed
requires: a mutex inside one process protects nothing) and a writer can be SIGKILLed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from orbit_sdk import fencing
from tests.fencing.dbs import DB


def ledger_insert(db: DB, conn: Any, key: str, token: int, operation_id: str, writer: int) -> None:
    mark = db.placeholder()
    cursor = conn.cursor()
    cursor.execute(
        f"INSERT INTO ledger (fence_key, token, operation_id, writer) VALUES ({mark}, {mark}, {mark}, {mark})",
        (key, token, operation_id, writer),
    )
    cursor.close()


def run_writes(spec: dict[str, Any]) -> None:
    db = DB(**spec["db"])
    conn = db.connect(spec.get("driver"))
    guard = fencing.Guard(conn)
    start = Path(spec["start_file"])
    while not start.exists():  # all writers begin together, so their writes interleave
        time.sleep(0.005)
    outcomes = []
    for key, token, operation_id in spec["ops"]:

        def write(connection: Any, key: str = key, token: int = token, operation_id: str = operation_id) -> Any:
            ledger_insert(db, connection, key, token, operation_id, spec["writer"])
            time.sleep(0.001)  # widen the window in which another writer would race
            return {"writer": spec["writer"], "token": token}

        try:
            applied = guard.apply(spec["namespace"], key, token, operation_id, write)
        except fencing.StaleToken as exc:
            outcomes.append({"key": key, "token": token, "op": operation_id, "kind": "stale", "highest": exc.highest})
            continue
        kind = "replayed" if applied.replayed else "applied"
        outcomes.append({"key": key, "token": token, "op": operation_id, "kind": kind, "result": applied.result})
    Path(spec["out"]).write_text(json.dumps(outcomes))


def run_crash(spec: dict[str, Any]) -> None:
    """Starts a guarded write and is SIGKILLed inside it: after the fence update, mid-write."""
    db = DB(**spec["db"])
    conn = db.connect(spec.get("driver"))
    guard = fencing.Guard(conn)

    def write(connection: Any) -> Any:
        ledger_insert(db, connection, spec["key"], spec["token"], spec["op"], 99)
        Path(spec["marker"]).write_text(str(os.getpid()))
        time.sleep(120)  # the test kills us here
        return "never"

    guard.write(spec["namespace"], spec["key"], spec["token"], spec["op"], write)


if __name__ == "__main__":
    given = json.loads(Path(sys.argv[1]).read_text())
    {"writes": run_writes, "crash": run_crash}[given["mode"]](given)

"""Worker connections across a move (SPEC §14, README Cells):
"Worker connections made to the old cell are closed (4503) and reconnect to
the new one" -- every one of them, whenever its heartbeat falls."""

from __future__ import annotations

import threading
import time
from typing import Any

from orbit_sdk import Worker
from tests.support.cells import MARKS, Installation

pytestmark = MARKS

WORKERS = 20  # their 5 s heartbeats spread over the cycle, 0.25 s apart


def test_every_worker_connected_during_a_move_reconnects_to_the_new_cell(installation: Installation) -> None:
    credential = installation.bootstrap("audworkers", "b")
    ran: list[str] = []
    stopped: dict[str, BaseException | None] = {}
    workers = []

    def run(worker: Worker, name: str) -> None:
        try:
            worker.run(handle_signals=False)
            stopped[name] = None
        except BaseException as exc:  # noqa: BLE001 - what stopped it
            stopped[name] = exc

    def handle(execution: Any) -> None:
        ran.append(execution.task.id)

    # The move's start-up overlaps the workers' staggered start; it begins once they all run.
    move = installation.prestart("orbit_move_application", "audworkers", "--to", "a", "--timeout", "30")
    try:
        for n in range(WORKERS):
            worker = Worker(
                installation.server.url, credential["token"], [credential["queue_id"]], {"h": handle}, 1,  # type: ignore[union-attr]
                worker_id=f"audworker-{n}", max_reconnect_delay=1.0,
            )  # fmt: skip
            workers.append(worker)
            threading.Thread(target=run, args=(worker, f"audworker-{n}"), daemon=True).start()
            time.sleep(5 / WORKERS)
        moved = move.run()
        assert "now served from cell a" in moved.stdout, moved.stdout
        time.sleep(6)  # every connection's heartbeat has fallen at least once after the move
        # A heartbeat after the old rows are removed finds no identity row in the old cell: the connection
        # is closed 4503 (moved, reconnect), not 4409 (superseded), which the SDK takes as final.
        assert stopped == {}, stopped
        for n in range(3):
            assert installation.submit("audworkers", f"audworkers-after-{n}").status_code in (200, 201)
        deadline = time.monotonic() + 20
        while len(set(ran)) < 3:
            assert time.monotonic() < deadline, ran
            time.sleep(0.1)
    finally:
        for worker in workers:
            worker.stop()

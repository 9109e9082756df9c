"""Workers killed with -9 while results hand Starts ahead: what is left started and never run.

Starts a private MariaDB (reliability/mariadb.py) and an Orbit server of the
checkout given (default: this one) on it, submits keyed tasks (`--keys 0`:
unkeyed ones) with a short lease, then runs SDK workers of that same checkout
(`orbit_sdk` imported from <repo>/sdk, checked at start-up) one after another,
each with a fresh worker_id, and kills each with SIGKILL after a random moment.
The SDK's results ask for the next task started ahead (`start_next`), so a kill
can land between the round that started a task and its handler. Every handler
first appends its attempt id to a ledger (flush + fsync), so the ledger says
which attempts a handler really ran. A last worker finishes what it can and is
stopped gracefully; after every lease has run out and been swept, the database
says what the killed workers left:

- NEEDS_REVIEW tasks, and of those how many whose attempt was RUNNING when its
  lease expired although no handler ever ran it (not in the ledger);
- Starts taken back: attempts RELEASED, started_at NULL, "connection closed
  before the assignment was acknowledged";
- tasks lost (not SUCCEEDED, NEEDS_REVIEW or WAITING) or duplicated (two
  SUCCEEDED attempts), and tasks whose handler ran in two attempts.

    .venv/bin/python -m bench.start_ahead_kill                      # this checkout
    .venv/bin/python -m bench.start_ahead_kill --repo /work/before  # another one
(from this checkout's root: the harness and its private MariaDB come from here)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.private_orbit import PrivateOrbit, private_orbit

HERE = Path(__file__).resolve().parent

TAKEN_BACK_MESSAGE = "connection closed before the assignment was acknowledged"
ACTIVE_STATES = ("LEASED", "RUNNING")

# The worker the bench runs, written into the work directory. It prints the
# orbit_sdk it imported, then "ready" once imports are done, so the kill
# moment is measured from a worker about to connect, not from interpreter start.
WORKER_SOURCE = """
import os, random, sys, time

import orbit_sdk
import orbit_sdk._connection

url, token, queue_id, worker_id, ledger, frames, capacity = sys.argv[1:8]
print(orbit_sdk.__file__, file=sys.stderr, flush=True)
encoded = orbit_sdk._connection.encoded


def noted(frame, request_id):
    # Every frame naming an attempt (the ack first of all) is noted before it is sent:
    # an attempt missing here was never acknowledged by this process.
    if "attempt_id" in frame:
        fd = os.open(frames, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{worker_id} {frame.get('type')} {frame['attempt_id']}\\n".encode())
        finally:
            os.close(fd)
    return encoded(frame, request_id)


orbit_sdk._connection.encoded = noted


def handler(execution):
    line = f"{execution.attempt_id} {execution.task.id}\\n".encode()
    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    time.sleep(random.uniform(0.005, 0.040))
    return {"ok": True}


worker = orbit_sdk.Worker(
    url, token, [queue_id], {"kill": handler}, capacity=int(capacity), concurrency_keys=True, worker_id=worker_id
)
print("ready", flush=True)
worker.run()
"""


def task_states(orbit: PrivateOrbit, queue_id: str) -> dict[str, int]:
    rows = orbit.query("SELECT state, COUNT(*) FROM orbit_task WHERE queue_id = %s GROUP BY state", (queue_id,))
    return {state: int(count) for state, count in rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    repo = Path(args.repo).resolve()
    python = str(repo / ".venv" / "bin" / "python")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="orbit-start-ahead-kill-"))
    worker_env = {**os.environ, "PYTHONPATH": f"{repo / 'sdk'}:{repo}"}
    # The SDK must be the checkout's own: the .venv's editable install points elsewhere.
    sdk_file = subprocess.run(
        [python, "-c", "import orbit_sdk; print(orbit_sdk.__file__)"],
        cwd=repo,
        env=worker_env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(sdk_file).resolve().is_relative_to(repo / "sdk"):
        raise SystemExit(f"orbit_sdk came from {sdk_file}, not {repo / 'sdk'}")
    print(f"repo {repo} at {commit}; orbit_sdk from {sdk_file}; work dir {work}", file=sys.stderr)
    worker_file = work / "worker.py"
    worker_file.write_text(WORKER_SOURCE)
    ledger = work / "ledger.txt"
    ledger.touch()
    frames = work / "frames.txt"  # type and attempt id of each frame naming an attempt, noted before sending
    frames.touch()
    with private_orbit(repo, "kill", work) as orbit:
        url, token = orbit.url, orbit.token
        queue_id = create_queue_and_tasks(args, url, token)

        def start_worker(label: str) -> tuple[str, subprocess.Popen[str]]:
            worker_id = f"kill-{label}-{uuid.uuid4().hex[:8]}"  # fresh: adopts no one's attempts
            log = open(work / f"worker-{label}.log", "w")  # noqa: SIM115
            process = subprocess.Popen(
                [
                    python,
                    str(worker_file),
                    url,
                    token,
                    queue_id,
                    worker_id,
                    str(ledger),
                    str(frames),
                    str(args.capacity),
                ],
                cwd=repo,
                env=worker_env,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            assert process.stdout is not None
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError(f"worker {label} did not start; see {log.name}")
            return worker_id, process

        kills: list[dict[str, Any]] = []
        for n in range(args.kills):
            runs_before = len(ledger.read_text().splitlines())
            worker_id, process = start_worker(f"k{n:02d}")
            ran = rng.uniform(args.min_run, args.max_run)
            time.sleep(ran)
            process.send_signal(signal.SIGKILL)
            process.wait()
            runs = len(ledger.read_text().splitlines()) - runs_before
            kills.append({"worker_id": worker_id, "ran_s": round(ran, 3), "handler_runs": runs})
            print(f"kill {n + 1}/{args.kills} after {ran:.2f} s, {runs} handler runs", file=sys.stderr)

        _, final = start_worker("final")
        finish(args, orbit, queue_id, final)
        final.send_signal(signal.SIGTERM)  # graceful: running handlers report
        try:
            final.wait(timeout=30)
        except subprocess.TimeoutExpired:
            final.kill()
            final.wait()
        # Until every lease the killed workers left has run out and been swept.
        deadline = time.monotonic() + args.lease_seconds + 30
        while orbit.query(
            "SELECT COUNT(*) FROM orbit_attempt WHERE queue_id = %s AND state IN %s",
            (queue_id, ACTIVE_STATES),
        )[0][0]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        summary = read_outcome(orbit, queue_id, ledger, frames)
        # What each killed worker's attempts came to, after the sweep.
        per_worker: dict[str, dict[str, int]] = collections.defaultdict(dict)
        for worker_id, state, count in orbit.query(
            "SELECT worker_id, state, COUNT(*) FROM orbit_attempt WHERE queue_id = %s GROUP BY worker_id, state",
            (queue_id,),
        ):
            per_worker[worker_id][state] = int(count)
        for kill in kills:
            kill["attempts"] = per_worker.get(kill["worker_id"], {})
        return {
            "repo": str(repo),
            "commit": commit,
            "orbit_sdk": sdk_file,
            "seed": args.seed,
            "tasks": args.tasks,
            "keys": args.keys,
            "capacity": args.capacity,
            "lease_seconds": args.lease_seconds,
            "kills": len(kills),
            "rounds": kills,
            "work_dir": str(work),
            **summary,
        }


def create_queue_and_tasks(args: argparse.Namespace, url: str, token: str) -> str:
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        # Its own queue with room to spare, so the queue's limits do not pace the workers.
        created = client.post(
            "/v1/queues",
            json={"name": "kill-open", "max_concurrency": 100, "rate_per_second": 10000},
            headers={"Idempotency-Key": uuid.uuid4().hex},
        )
        assert created.status_code == 201, created.text
        queue_id: str = created.json()["data"]["queue"]["id"]
        bodies = [
            {
                "idempotency_key": uuid.uuid4().hex,
                "task": {
                    "queue_id": queue_id,
                    "handler": "kill",
                    "handler_version": "v1",
                    "payload_version": "v1",
                    "payload": {"n": n},
                    **({"concurrency_key": f"kill/{n % args.keys}"} if args.keys else {}),
                    "lease_seconds": args.lease_seconds,
                },
            }
            for n in range(args.tasks)
        ]
        for first in range(0, len(bodies), 500):  # a batch takes at most 500
            answer = client.post("/v1/tasks:batch", json={"tasks": bodies[first : first + 500]})
            assert answer.status_code == 200, answer.text
            refused = [item for item in answer.json()["data"]["results"] if item.get("status") != 201]
            assert not refused, refused[:3]
    return queue_id


def finish(args: argparse.Namespace, orbit: PrivateOrbit, queue_id: str, worker: subprocess.Popen[str]) -> None:
    """Lets the last worker run until nothing is left to do, or nothing moves for longer than a lease."""
    deadline = time.monotonic() + args.finish_seconds
    last: dict[str, int] = {}
    moved = time.monotonic()
    while time.monotonic() < deadline and worker.poll() is None:
        states = task_states(orbit, queue_id)
        if not any(states.get(state, 0) for state in ("WAITING", *ACTIVE_STATES)):
            return
        if states != last:
            last, moved = states, time.monotonic()
        elif time.monotonic() - moved > args.lease_seconds + 5:
            return
        time.sleep(0.5)


def read_outcome(orbit: PrivateOrbit, queue_id: str, ledger: Path, frames: Path) -> dict[str, Any]:
    ran: dict[str, str] = {}  # attempt id -> task id, of every attempt a handler ran
    for line in ledger.read_text().splitlines():
        attempt_id, task_id = line.split()
        ran[attempt_id] = task_id
    named: dict[str, list[str]] = collections.defaultdict(list)  # attempt id -> frames the workers sent about it
    sent_after: dict[str, int] = {}  # attempt id -> frames its worker sent after the last one naming it
    per_worker: collections.Counter[str] = collections.Counter()
    last_position: dict[str, tuple[str, int]] = {}
    for line in frames.read_text().splitlines():
        worker_id, kind, attempt_id = line.split()
        named[attempt_id].append(kind)
        per_worker[worker_id] += 1
        last_position[attempt_id] = (worker_id, per_worker[worker_id])
    for attempt_id, (worker_id, position) in last_position.items():
        sent_after[attempt_id] = per_worker[worker_id] - position
    tasks = dict(orbit.query("SELECT id, state FROM orbit_task WHERE queue_id = %s", (queue_id,)))
    attempts = orbit.query(
        "SELECT id, task_id, state, number, started_at, leased_at, error, worker_id, lease_expires_at"
        " FROM orbit_attempt WHERE queue_id = %s",
        (queue_id,),
    )
    states = collections.Counter(tasks.values())
    succeeded_per_task: collections.Counter[str] = collections.Counter()
    run_attempts_per_task: collections.Counter[str] = collections.Counter()
    review_ran = review_never_ran = review_never_ran_ahead = 0
    taken_back = started_ahead = 0
    never_ran: list[dict[str, Any]] = []
    for attempt_id, task_id, state, _number, started_at, leased_at, error, worker_id, expires in attempts:
        message = json.loads(error).get("message") if error else None
        code = json.loads(error).get("code") if error else None
        if started_at is not None and started_at == leased_at:
            started_ahead += 1
        if attempt_id in ran:
            run_attempts_per_task[task_id] += 1
        if state == "SUCCEEDED":
            succeeded_per_task[task_id] += 1
        if state == "RELEASED" and started_at is None and message == TAKEN_BACK_MESSAGE:
            taken_back += 1
        # A NEEDS_REVIEW task's ending: its attempt was RUNNING when the lease expired.
        if state == "UNKNOWN" and code == "LEASE_EXPIRED" and tasks.get(task_id) == "NEEDS_REVIEW":
            if attempt_id in ran:
                review_ran += 1
            else:
                review_never_ran += 1
                review_never_ran_ahead += started_at is not None and started_at == leased_at
                never_ran.append(
                    {
                        "attempt_id": attempt_id,
                        "task_id": task_id,
                        "worker_id": worker_id,
                        "leased_at": str(leased_at),
                        "started_at": str(started_at),
                        "lease_expires_at": str(expires),
                        "frames_sent_naming_it": named.get(attempt_id, []),
                        "frames_its_worker_sent_after": sent_after.get(attempt_id),
                    }
                )
    lost = sum(count for state, count in states.items() if state not in ("SUCCEEDED", "NEEDS_REVIEW", "WAITING"))
    return {
        "task_states": dict(sorted(states.items())),
        "needs_review": states.get("NEEDS_REVIEW", 0),
        "needs_review_never_ran": review_never_ran,
        "needs_review_never_ran_started_ahead": review_never_ran_ahead,
        "needs_review_never_ran_acknowledged": sum(1 for a in never_ran if a["frames_sent_naming_it"]),
        "needs_review_handler_ran": review_ran,
        "never_ran": never_ran,
        "taken_back": taken_back,
        "attempts": len(attempts),
        "attempts_started_ahead": started_ahead,
        "handler_runs": len(ran),
        "lost": lost,
        "duplicated": sum(1 for count in succeeded_per_task.values() if count > 1),
        "ran_in_two_attempts": sum(1 for count in run_attempts_per_task.values() if count > 1),
    }


def table_row(summary: dict[str, Any]) -> str:
    states = summary["task_states"]
    cells = [
        summary["commit"],
        summary["kills"],
        summary["tasks"],
        states.get("SUCCEEDED", 0),
        states.get("WAITING", 0),
        summary["needs_review"],
        summary["needs_review_never_ran"],
        summary["needs_review_never_ran_acknowledged"],
        summary["needs_review_handler_ran"],
        summary["taken_back"],
        summary["lost"],
        summary["duplicated"],
        summary["ran_in_two_attempts"],
    ]
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=str(HERE.parent), help="the Orbit checkout whose server and SDK to run")
    parser.add_argument("--tasks", type=int, default=2000, help="tasks (400 run out in ~10 rounds)")
    parser.add_argument("--keys", type=int, default=8, help="keys the tasks spread over (0: unkeyed tasks)")
    parser.add_argument("--capacity", type=int, default=4)
    parser.add_argument("--lease-seconds", type=int, default=5, help="each task's lease_seconds (5-3600)")
    parser.add_argument("--kills", type=int, default=20, help="workers started and killed with SIGKILL")
    parser.add_argument("--min-run", type=float, default=0.3, help="shortest run before a kill, seconds")
    parser.add_argument("--max-run", type=float, default=1.5, help="longest run before a kill, seconds")
    parser.add_argument("--finish-seconds", type=float, default=120, help="at most this long for the last worker")
    parser.add_argument("--seed", type=int, default=None, help="seeds the kill moments (default: random)")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = random.randrange(1 << 31)
    summary = run(args)
    print(json.dumps(summary, indent=2))
    print(
        "| commit | kills | tasks | SUCCEEDED | WAITING | NEEDS_REVIEW | never ran | of those acked | handler ran "
        "| taken back | lost | duplicated | ran twice |"
    )
    print(table_row(summary))


if __name__ == "__main__":
    main()

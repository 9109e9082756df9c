"""W6, multi-tenant (SPEC §14): several applications submitting and working at
once, on 1 cell or 2 cells, with 1 or 2 server processes, in one invocation.

    .venv/bin/python -m bench.multi_tenant [--applications 8] [--tasks 300] [--runs 1]

Two private MariaDB servers (reliability/mariadb.py) are started once, one per
cell; the directory is a database of the first. For each configuration, fresh
databases, `migrate`, one application per `orbit_bootstrap` (placed round robin
over the cells), this checkout's server (`python -m orbit.serve`, or
`python -m server.supervisor --processes 2`), one SDK worker process per
application (bench/systems/orbit_worker.py, capacity 32), and two submitter
threads per application calling the SDK's Client one task at a time. Measured:
the aggregate tasks/s from the first submit to the last completion, and the CPU
seconds per 1,000 tasks of each MariaDB server, of the server processes and of
the whole machine (/proc/stat). With 1 cell the second MariaDB idles.

On a 2-core machine the two cells compete for the same cores as the server,
the workers and the submitters: the figures say what this machine does, not
what two primaries on two hosts would (docs/architecture/cells.md)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import common
from orbit_sdk import Client, SubmitTaskRequest
from reliability.mariadb import PrivateMariaDB

CAPACITY = 32
SUBMITTERS_PER_APPLICATION = 2
CONFIGURATIONS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (cells, server processes)


def cpu_seconds(pids: list[int]) -> float:
    table = common.process_table()
    return sum(table[pid][4] for pid in common.process_tree(pids, table)) / common.CLK_TCK


def manage(env: dict[str, str], *args: str) -> None:
    subprocess.run(
        [str(common.ORBIT_PYTHON), "manage.py", *args], cwd=common.ROOT, env=env, check=True, stdout=subprocess.DEVNULL
    )


def run_configuration(
    databases: list[PrivateMariaDB], cells: int, processes: int, applications: int, tasks: int, work: Path
) -> dict[str, Any]:
    tag = f"c{cells}p{processes}-{time.time_ns()}"
    directory = f"w6_dir_{tag}".replace("-", "_")
    cell_dbs = {name: (databases[n], f"w6_{name}_{tag}".replace("-", "_")) for n, name in enumerate("ab"[:cells])}
    databases[0].create_database(directory)
    for db, name in cell_dbs.values():
        db.create_database(name)
    env = {key: value for key, value in os.environ.items() if not key.startswith("ORBIT_")}
    env.update(
        ORBIT_MYSQL_DSN=databases[0].dsn(directory),
        ORBIT_CELLS=json.dumps({name: db.dsn(database) for name, (db, database) in cell_dbs.items()}),
        ORBIT_MAINTENANCE="1",
        ORBIT_SECRET_KEY="bench-multi-tenant",
    )
    manage(env, "migrate", "-v0")
    credentials = []
    for n in range(applications):
        path = work / f"{tag}-app{n}.json"
        cell = "ab"[n % cells]
        manage(
            env,
            "orbit_bootstrap", "--application", f"tenant-{n}", "--namespace", "bench", "--environment", "bench",
            "--queue", "w6", "--max-concurrency", "10000", "--rate-per-second", "1000000", "--worker-access",
            "--output", str(path), "--cell", cell,
        )  # fmt: skip
        credentials.append(json.loads(path.read_text()))
    port = common.free_port()
    server_module = ["orbit.serve"] if processes == 1 else ["server.supervisor", "--processes", str(processes)]
    log = work / f"{tag}-server.log"
    server = common.spawn(
        [str(common.ORBIT_PYTHON), "-m", *server_module, "-b", "127.0.0.1", "-p", str(port), "orbit.asgi:application"],
        env=env,
        cwd=common.ROOT,
        log=log,
    )
    workers: list[subprocess.Popen] = []
    try:
        if processes == 1:
            started = common.wait_until(lambda: common.tcp_up(port), 30)
        else:
            started = common.wait_until(lambda: log.exists() and b"orbit: serving on " in log.read_bytes(), 30)
        if not started:
            raise RuntimeError(f"orbit server did not start; see {log}")
        url = f"http://127.0.0.1:{port}"
        events = common.EventLog(common.work_dir(f"w6-events-{tag}"))
        for n, credential in enumerate(credentials):
            workers.append(
                common.spawn(
                    [str(common.ORBIT_PYTHON), "-m", "bench.systems.orbit_worker", url, credential["token"]]
                    + [credential["queue_id"], str(CAPACITY), f"w6-{tag}-{n}"],
                    env={**env, **events.env()},
                    cwd=common.ROOT,
                    log=work / f"{tag}-worker{n}.log",
                )
            )
        deadline = time.monotonic() + 60
        while len(events.poll().ready) < applications:
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not start")
            time.sleep(0.05)
        labels = {n: [f"a{n}-t{i}" for i in range(tasks)] for n in range(applications)}
        cell_pids = {name: db.process.pid for name, (db, _) in cell_dbs.items() if db.process is not None}
        idle = {name: db.process.pid for name, db in zip("ab", databases, strict=True) if db.process is not None}
        before = {
            "cells": {name: cpu_seconds([pid]) for name, pid in idle.items()},
            "server": cpu_seconds([server.pid]),
            "machine": common.machine_jiffies()[0] / common.CLK_TCK,
        }
        failures: list[BaseException] = []

        def submitter(n: int, part: list[str]) -> None:
            credential = credentials[n]
            try:
                with Client(url, credential["token"], timeout=60) as client:
                    for label in part:
                        request = SubmitTaskRequest(
                            queue_id=credential["queue_id"], handler="noop", handler_version="v1",
                            payload_version="v1", payload={"k": label},
                        )  # fmt: skip
                        client.submit_task(f"w6-{label}", request)
            except BaseException as exc:  # noqa: BLE001 - reported by the harness's thread
                failures.append(exc)

        threads = [
            threading.Thread(target=submitter, args=(n, labels[n][k::SUBMITTERS_PER_APPLICATION]), daemon=True)
            for n in range(applications)
            for k in range(SUBMITTERS_PER_APPLICATION)
        ]
        began = time.time()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise RuntimeError(f"a submit failed: {failures[0]!r}")
        every = [label for part in labels.values() for label in part]
        deadline = time.monotonic() + 300
        while events.poll().done_count(every) < len(every):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{events.done_count(every)}/{len(every)} tasks done")
            time.sleep(0.05)
        finished = max(events.dones[label][0][0] for label in every)
        total = len(every)
        per_1k = 1000 / total
        after_cells = {name: cpu_seconds([pid]) for name, pid in idle.items()}
        result = {
            "cells": cells,
            "server_processes": processes,
            "applications": applications,
            "tasks": total,
            "tasks_per_s": round(total / (finished - began), 1),
            "server_cpu_s_per_1k": round((cpu_seconds([server.pid]) - before["server"]) * per_1k, 3),
            "machine_cpu_s_per_1k": round(
                (common.machine_jiffies()[0] / common.CLK_TCK - before["machine"]) * per_1k, 3
            ),
        }
        for name in idle:
            used = after_cells[name] - before["cells"][name]
            result[f"mariadb_{name}_cpu_s_per_1k"] = round(used * per_1k, 3)
            if name in cell_pids:
                in_cell = sum(len(labels[n]) for n in range(applications) if "ab"[n % cells] == name)
                result[f"mariadb_{name}_tasks"] = in_cell
                result[f"mariadb_{name}_cpu_s_per_1k_of_its_tasks"] = round(used * 1000 / in_cell, 3)
        return result
    finally:
        for worker in workers:
            common.stop_process(worker, timeout=5)
        common.stop_process(server, timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--applications", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=300, help="tasks per application")
    parser.add_argument("--runs", type=int, default=1, help="rounds of the four configurations, interleaved")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="orbit-w6-", dir=base))
    work.chmod(0o755)  # the private servers run as the mysql user
    databases = [PrivateMariaDB(work / f"mariadb-{name}") for name in "ab"]
    results = []
    try:
        for db in databases:
            db.start()
        for run in range(args.runs):
            for cells, processes in CONFIGURATIONS:
                result = run_configuration(databases, cells, processes, args.applications, args.tasks, work)
                result["run"] = run + 1
                results.append(result)
                print(json.dumps(result), flush=True)
    finally:
        for db in databases:
            db.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

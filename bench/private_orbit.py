"""An Orbit server of a given checkout on a private MariaDB, for the benches that
measure one server from outside (trips per task, kill -9 of workers).

    with private_orbit(repo, "trips", work) as orbit:
        httpx.get(f"{orbit.url}/v1/queues", headers=orbit.headers)

The server runs the checkout's own code (`python -m orbit.serve` there, its
.venv's Python), on a database of its own, bootstrapped with a credential that
may also work; everything is stopped and removed on leaving."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import free_port
from reliability.mariadb import PrivateMariaDB


@dataclass
class PrivateOrbit:
    repo: Path
    python: str
    db: PrivateMariaDB
    database: str
    url: str
    token: str
    env: dict[str, str]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        connection = self.db.connect(self.database)
        try:
            cursor = connection.cursor()
            cursor.execute(sql, params)
            return list(cursor.fetchall())
        finally:
            connection.close()


def wait_for_port(port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@contextmanager
def private_orbit(repo: Path, name: str, work: Path, mariadb_args: tuple[str, ...] = ()) -> Iterator[PrivateOrbit]:
    """The checkout `repo`'s server on a private MariaDB under `work`, its database,
    application, namespace and queue all called `name`; `mariadb_args`: more
    mariadbd options."""
    python = str(repo / ".venv" / "bin" / "python")
    work.chmod(0o755)  # the private server runs as the mysql user
    db = PrivateMariaDB(work / "mariadb", extra_args=mariadb_args)
    db.start()
    server = None
    try:
        database = f"orbit_{name}"
        db.create_database(database)
        env = {**os.environ, "ORBIT_MYSQL_DSN": db.dsn(database), "ORBIT_MAINTENANCE": "1"}
        env.pop("ORBIT_INLINE_DB", None)
        subprocess.run([python, "manage.py", "migrate", "-v0"], cwd=repo, env=env, check=True)
        credentials = work / "credentials.json"
        subprocess.run(
            [python, "manage.py", "orbit_bootstrap", "--application", name, "--namespace", name]
            + ["--environment", "bench", "--queue", name, "--worker-access", "--output", str(credentials)],
            cwd=repo,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        port = free_port()
        with open(work / "server.log", "w") as log:
            server = subprocess.Popen(
                [python, "-m", "orbit.serve", "-b", "127.0.0.1", "-p", str(port), "orbit.asgi:application"],
                cwd=repo,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for_port(port, 30)
        token = json.loads(credentials.read_text())["token"]
        yield PrivateOrbit(repo, python, db, database, f"http://127.0.0.1:{port}", token, env)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        db.cleanup()

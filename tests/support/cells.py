"""Two cells for the tests (SPEC §14): the directory and cell a on the
suite's MariaDB, cell b on a private MariaDB of its own (so it can be
frozen), a live server serving both, and the commands an operator runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import MySQLdb
import pytest
from django.conf import settings

from orbit_sdk import Client
from reliability.mariadb import PrivateMariaDB, available
from tests.support.live import LIVE_METRICS_TOKEN, ROOT, LiveServer

SHARED = settings.DATABASES["default"]
# Every module of tests/cells: cells are MySQL/MariaDB databases, and cell b is a private MariaDB.
MARKS = [
    pytest.mark.skipif(SHARED["ENGINE"] != "orbit.db.mysql", reason="cells are MySQL/MariaDB databases"),
    pytest.mark.skipif(available() is not None, reason=f"no private MariaDB: {available()}"),
    pytest.mark.timeout(240),
]
SUFFIX = f"{os.getpid()}"
DIRECTORY_DB, CELL_A_DB, CELL_B_DB = f"orbit_cells_dir_{SUFFIX}", f"orbit_cells_a_{SUFFIX}", f"orbit_cells_b_{SUFFIX}"
DIRECTORY_TABLES = {"orbit_cell_placement", "orbit_credential_placement"}


def shared_connection() -> Any:
    return MySQLdb.connect(
        host=SHARED["HOST"], port=int(SHARED["PORT"]), user=SHARED["USER"], passwd=SHARED["PASSWORD"], charset="utf8mb4"
    )


def shared_dsn(database: str) -> str:
    return f"mysql://{SHARED['USER']}:{SHARED['PASSWORD']}@{SHARED['HOST']}:{SHARED['PORT']}/{database}"


class Installation:
    def __init__(self, tmp: Path, private: PrivateMariaDB) -> None:
        self.tmp = tmp
        self.private = private
        cells = {"a": shared_dsn(CELL_A_DB), "b": private.dsn(CELL_B_DB)}
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("ORBIT_")}
        self.env.update(
            ORBIT_MYSQL_DSN=shared_dsn(DIRECTORY_DB),
            ORBIT_CELLS=json.dumps(cells),
            ORBIT_MAINTENANCE="1",
            ORBIT_METRICS_TOKEN=LIVE_METRICS_TOKEN,
        )
        self.credentials: dict[str, dict[str, Any]] = {}
        self.server: LiveServer | None = None

    def manage(self, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check:
            assert result.returncode == 0, result.stdout + result.stderr
        return result

    def bootstrap(self, application: str, *cell: str) -> dict[str, Any]:
        output = self.tmp / f"{application}.json"
        self.manage(
            "orbit_bootstrap",
            "--application", application, "--namespace", "n", "--environment", "e", "--queue", "q",
            "--worker-access", "--output", str(output), *(["--cell", cell[0]] if cell else []),
        )  # fmt: skip
        self.credentials[application] = json.loads(output.read_text())
        return self.credentials[application]

    def client(self, application: str) -> Client:
        assert self.server is not None
        return Client(self.server.url, self.credentials[application]["token"], timeout=30)

    def scrape(self) -> tuple[httpx.Response, float]:
        """GET /metrics as the platform operator, and how long it took."""
        assert self.server is not None
        began = time.monotonic()
        answer = httpx.get(
            f"{self.server.url}/metrics", headers={"Authorization": f"Bearer {LIVE_METRICS_TOKEN}"}, timeout=30
        )
        return answer, time.monotonic() - began

    def submit(self, application: str, key: str) -> httpx.Response:
        assert self.server is not None
        credential = self.credentials[application]
        body = {"queue_id": credential["queue_id"], "handler": "h", "handler_version": "v1", "payload_version": "v1"}
        return httpx.post(
            f"{self.server.url}/v1/tasks",
            json={**body, "payload": {"key": key}},
            headers={"Authorization": f"Bearer {credential['token']}", "Idempotency-Key": key},
            timeout=30,
        )


def table_names(connection: Any, database: str) -> set[str]:
    cursor = connection.cursor()
    cursor.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (database,))
    return {row[0] for row in cursor.fetchall()}


def column_values(connection: Any, database: str, table: str, column: str) -> set[str]:
    cursor = connection.cursor()
    cursor.execute(f"SELECT `{column}` FROM `{database}`.`{table}`")  # noqa: S608 - the test's own names
    return {row[0] for row in cursor.fetchall()}


def running_installation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installation]:
    """The installation (tests/cells/conftest.py makes it once for the package)."""
    tmp = tmp_path_factory.mktemp("cells")
    # The private mysqld runs as the mysql user, which cannot enter pytest's temporary directories.
    private_dir = Path(
        tempfile.mkdtemp(prefix="orbit-cell-b-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    )
    private_dir.chmod(0o755)
    private = PrivateMariaDB(private_dir / "mariadb")
    shared = shared_connection()
    try:
        private.start()
        private.create_database(CELL_B_DB)
        for name in (DIRECTORY_DB, CELL_A_DB):
            shared.cursor().execute(f"DROP DATABASE IF EXISTS `{name}`")
            shared.cursor().execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
        world = Installation(tmp, private)
        world.manage("migrate", "-v0")
        world.bootstrap("alpha", "a")
        world.bootstrap("beta", "b")
        (ROOT / ".local").mkdir(exist_ok=True)
        world.server = LiveServer(world.env)
        yield world
    finally:
        if "world" in locals() and world.server is not None:
            world.server.stop()
        private.cleanup()
        shutil.rmtree(private_dir, ignore_errors=True)
        for name in (DIRECTORY_DB, CELL_A_DB):
            shared.cursor().execute(f"DROP DATABASE IF EXISTS `{name}`")
        shared.close()

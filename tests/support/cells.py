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
import threading
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
from tests.support.concurrent import concurrently
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
# `python manage.py ARGS` in a process that has already imported Django and Orbit (and the
# command's module, when the command is known at the start: argv[1]), then waits for ARGS
# on stdin (a JSON list) and runs manage.py's command line with them as it is. Neither
# django.setup() nor an import reads a database (the directory's caches fill on first use):
# nothing the command reads is read before it is given its arguments.
PRESTART = """
import importlib, json, os, runpy, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")
import django
django.setup()
from django.core.management import get_commands
import server.cli
for name in sys.argv[1:2]:
    app = get_commands().get(name)
    if isinstance(app, str):
        importlib.import_module(f"{app}.management.commands.{name}")
sys.argv = ["manage.py", *json.loads(sys.stdin.readline())]
runpy.run_path("manage.py", run_name="__main__")
"""


def shared_connection() -> Any:
    return MySQLdb.connect(
        host=SHARED["HOST"], port=int(SHARED["PORT"]), user=SHARED["USER"], passwd=SHARED["PASSWORD"], charset="utf8mb4"
    )


def shared_dsn(database: str) -> str:
    return f"mysql://{SHARED['USER']}:{SHARED['PASSWORD']}@{SHARED['HOST']}:{SHARED['PORT']}/{database}"


class Prestarted:
    """A manage.py process started ahead of its command: its second or so of imports
    overlaps what the test waits for before it (a move's settle, a worker's start,
    the command before), and nothing it does begins before run()."""

    def __init__(self, env: dict[str, str], command: str | None = None) -> None:
        self.ran = False
        self.process = subprocess.Popen(
            [sys.executable, "-c", PRESTART, *([command] if command else [])],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`manage.py ARGS`'s result, as Installation.manage gives it."""
        assert not self.ran, "a prestarted process runs one command"
        self.ran = True
        try:
            stdout, stderr = self.process.communicate(json.dumps(args) + "\n", timeout=120)
        except subprocess.TimeoutExpired:
            self.discard()
            raise
        result = subprocess.CompletedProcess(["manage.py", *args], self.process.returncode, stdout, stderr)
        if check:
            assert result.returncode == 0, result.stdout + result.stderr
        return result

    def discard(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()


class Command:
    """One command line, its process started ahead (Installation.prestart)."""

    def __init__(self, process: Prestarted, args: tuple[str, ...]) -> None:
        self.process = process
        self.args = args

    def run(self, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.process.run(*self.args, check=check)


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
        # Every process started ahead (a test failing before it runs leaves it to the teardown),
        # and the one the next manage() takes.
        self.prestarted: list[Prestarted] = []
        self.spares: list[Prestarted] = []
        self.spares_lock = threading.Lock()

    def manage(self, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
        if env:  # a settings error must be manage.py's one line, not django.setup()'s ahead of it
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
        # The tests run one command after another, mostly waiting in between: each takes the
        # process started during the one before, and starts the next one's.
        with self.spares_lock:
            process = self.spares.pop() if self.spares else self._started()
            if not self.spares:
                self.spares.append(self._started())
        return process.run(*args, check=check)

    def start_spares(self, count: int) -> None:
        """Processes for that many manage() calls about to run at once."""
        with self.spares_lock:
            self.spares += [self._started() for _ in range(count - len(self.spares))]

    def prestart(self, *args: str) -> Command:
        """manage(*args) with its process started now (its command's module imported too),
        for a test to run in its turn."""
        return Command(self._started(args[0]), args)

    def _started(self, command: str | None = None) -> Prestarted:
        prestarted = Prestarted(self.env, command)
        self.prestarted.append(prestarted)
        return prestarted

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
        world = Installation(tmp, private)
        # The private MariaDB's first start (initialising its datadir) is most of the set-up's
        # wait, and the shared databases do not need it: made meanwhile, as is migrate's start-up.
        migrate = world.prestart("migrate", "-v0")
        world.start_spares(2)  # alpha's and beta's bootstraps

        def shared_databases() -> None:
            for name in (DIRECTORY_DB, CELL_A_DB):
                shared.cursor().execute(f"DROP DATABASE IF EXISTS `{name}`")
                shared.cursor().execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")

        concurrently({"cell b": private.start, "directory and cell a": shared_databases})
        private.create_database(CELL_B_DB)
        migrate.run()
        # Two applications in their cells and the server: none needs another.
        (ROOT / ".local").mkdir(exist_ok=True)
        concurrently(
            {
                "alpha": lambda: world.bootstrap("alpha", "a"),
                "beta": lambda: world.bootstrap("beta", "b"),
                "server": lambda: setattr(world, "server", LiveServer(world.env)),
            }
        )
        yield world
    finally:
        if "world" in locals():
            for prestarted in world.prestarted:
                prestarted.discard()
            if world.server is not None:
                world.server.stop()
        private.cleanup()
        shutil.rmtree(private_dir, ignore_errors=True)
        for name in (DIRECTORY_DB, CELL_A_DB):
            shared.cursor().execute(f"DROP DATABASE IF EXISTS `{name}`")
        shared.close()

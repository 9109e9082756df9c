"""`orbit serve` (here as `manage.py serve`, the same code): one start-up
line, a warning for the development secret key, and every reason it cannot
serve as one line on stderr with exit status 1, never a traceback."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.db import connection

from tests.product.conftest import closed_port
from tests.support.live import ROOT, free_port, server_env

START_LINE = re.compile(
    r"orbit: serving on http://127\.0\.0\.1:(\d+); database (mysql \"[^\"]+\" at [^;]+|sqlite [^;]+); "
    r"processes \d+; pid (\d+)"
)
SECRET = {"ORBIT_SECRET_KEY": "a-production-secret-for-the-tests"}

# pytest-django creates the test database only for a session with db-marked tests.
pytestmark = pytest.mark.django_db


@pytest.fixture
def env(django_db_setup: None, django_db_blocker: Any):
    """The environment of a server on the (migrated) test database."""
    with django_db_blocker.unblock():
        made = server_env()
    made.pop("ORBIT_SECRET_KEY", None)
    made.pop("ORBIT_HTTP_ADDR", None)
    return made


def serve(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """`manage.py serve` that is expected to exit on its own."""
    return subprocess.run(
        [sys.executable, "manage.py", "serve", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def started(arguments: list[str], env: dict[str, str], stdout: Path, stderr: Path) -> subprocess.Popen[bytes]:
    """`manage.py` with `arguments`, once it has printed its first line."""
    with stdout.open("w") as out, stderr.open("w") as err:
        process = subprocess.Popen([sys.executable, "manage.py", *arguments], cwd=ROOT, env=env, stdout=out, stderr=err)
    deadline = time.monotonic() + 30
    while not stdout.read_text() and time.monotonic() < deadline:
        assert process.poll() is None, stderr.read_text()
        time.sleep(0.05)
    return process


def assert_one_line_failure(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("orbit serve: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_serve_prints_one_start_up_line_and_warns_about_the_development_key(env, tmp_path: Path):
    port = free_port()
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    # The address: ORBIT_HTTP_ADDR's, and no ORBIT_SECRET_KEY.
    process = started(["serve"], {**env, "ORBIT_HTTP_ADDR": f"127.0.0.1:{port}"}, stdout, stderr)
    try:
        first = stdout.read_text()
        match = START_LINE.fullmatch(first.rstrip("\n"))
        assert match and first.count("\n") == 1, first
        assert int(match[1]) == port and int(match[3]) == process.pid
        settings = connection.settings_dict
        assert str(settings["NAME"]) in match[2] and connection.vendor in match[2]
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
        assert ready.status_code == 200, ready.text
    finally:
        process.terminate()
        process.wait(timeout=15)
    warning = stderr.read_text().splitlines()
    assert len(warning) == 1 and "ORBIT_SECRET_KEY" in warning[0] and "warning" in warning[0], warning
    # After the start-up line only daphne's access log: one line per request.
    later = stdout.read_text().splitlines()[1:]
    assert len(later) == 2 and all('"GET /' in line for line in later), later


def test_an_unreachable_database_server_is_one_line_and_exit_1(env):
    env = {**env, **SECRET, "ORBIT_MYSQL_DSN": f"mysql://root:@127.0.0.1:{closed_port()}/orbit"}
    assert_one_line_failure(serve(env), "cannot reach the database server at 127.0.0.1:")


def test_a_missing_database_is_one_line_and_exit_1(env, tmp_path: Path):
    if connection.vendor == "sqlite":
        missing = tmp_path / "missing.sqlite3"
        assert_one_line_failure(serve({**env, **SECRET, "ORBIT_SQLITE_PATH": str(missing)}), str(missing))
        assert not missing.exists()  # the check does not create it
    else:
        dsn = env["ORBIT_MYSQL_DSN"].rsplit("/", 1)[0] + "/orbit_no_such_database"
        result = serve({**env, **SECRET, "ORBIT_MYSQL_DSN": dsn})
        assert_one_line_failure(result, 'database "orbit_no_such_database" does not exist')


def test_unapplied_migrations_are_one_line_and_exit_1(env, empty_database):
    if connection.vendor == "sqlite":
        env = {**env, "ORBIT_SQLITE_PATH": empty_database["NAME"]}
    else:
        env = {**env, "ORBIT_MYSQL_DSN": env["ORBIT_MYSQL_DSN"].rsplit("/", 1)[0] + "/" + empty_database["NAME"]}
    assert_one_line_failure(serve({**env, **SECRET}), "migrations not applied", "orbit migrate")


def test_a_malformed_dsn_is_one_line_and_exit_1(env):
    result = serve({**env, **SECRET, "ORBIT_MYSQL_DSN": "postgres://db/orbit"})
    assert_one_line_failure(result, "ORBIT_MYSQL_DSN must look like mysql://")


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_port_in_use_is_one_line_and_exit_1(env, processes):
    """The same line whether the supervisor or daphne itself finds the port taken."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve({**env, **SECRET}, "-b", "127.0.0.1", "-p", str(port), "--processes", processes)
    assert_one_line_failure(result, f"orbit serve: Listen failure: Couldn't listen on 127.0.0.1:{port}: ")


def test_the_address_defaults_to_orbit_http_addr(env):
    # A bad value is reported before anything is started.
    assert_one_line_failure(serve({**env, **SECRET, "ORBIT_HTTP_ADDR": "nowhere"}), "ORBIT_HTTP_ADDR")


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_lone_server_stops_gracefully_on_sigterm_and_on_a_hang_up(env, tmp_path: Path, stop: signal.Signals):
    """A terminal's hang-up (or a service manager's reload) stops the server as
    SIGTERM does, with exit 0 and its log flushed, rather than killing it."""
    port = free_port()
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    arguments = ["serve", "--processes", "1", "-b", "127.0.0.1", "-p", str(port)]
    process = started(arguments, {**env, **SECRET}, stdout, stderr)
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        process.send_signal(stop)
        assert process.wait(timeout=30) == 0, stderr.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines = stdout.read_text().splitlines()
    assert START_LINE.fullmatch(lines[0]) and len(lines) == 2 and '"GET /healthz' in lines[1], lines
    assert "Traceback" not in stderr.read_text()

"""Every `orbit <command>` (here `manage.py`, the same server/cli.py main) that
cannot use its database says so in one line on stderr, naming the database
(never the password) and what to do, and exits 1: no traceback. Run the way a
new operator runs them, as subprocesses against a database that is missing,
a port nobody listens on, a user the server refuses, and a database never
migrated. Other errors are reported as before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from server.probes import database_settings
from tests.product.conftest import closed_port
from tests.support.live import ROOT, server_env

# pytest-django creates the test database only for a session with db-marked tests.
pytestmark = pytest.mark.django_db

SECRET = {"ORBIT_SECRET_KEY": "a-production-secret-for-the-tests"}
BOOTSTRAP = ["--application", "a", "--namespace", "n", "--environment", "e", "--queue", "q"]


@pytest.fixture
def env(django_db_setup: None, django_db_blocker: Any) -> dict[str, str]:
    """The environment of a command on the (migrated) test database."""
    with django_db_blocker.unblock():
        made = server_env()
    for name in ("ORBIT_URL", "ORBIT_HTTP_ADDR"):
        made.pop(name, None)
    return {**made, **SECRET}


def orbit(env: dict[str, str], *args: str | bytes) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def commands(tmp_path: Path) -> dict[str, list[str]]:
    """The set-up commands of README's Production, each as a new operator types it."""
    return {
        "migrate": ["migrate"],
        "orbit_check": ["orbit_check"],
        "orbit_bootstrap": ["orbit_bootstrap", *BOOTSTRAP, "--output", str(tmp_path / "creds.json")],
        "serve": ["serve", "-b", "127.0.0.1", "-p", "0"],
    }


def assert_one_line(result: subprocess.CompletedProcess[str], command: str, *fragments: str) -> str:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{'orbit' if command == 'serve' else 'manage.py'} {command}: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def with_database(env: dict[str, str], name: str) -> dict[str, str]:
    return {**env, "ORBIT_MYSQL_DSN": env["ORBIT_MYSQL_DSN"].rsplit("/", 1)[0] + "/" + name}


def one_database(env: dict[str, str]) -> dict[str, str]:
    """The environment of an installation without cells (the suite may run on two)."""
    return {name: value for name, value in env.items() if name != "ORBIT_CELLS"}


@pytest.mark.mysql_only  # SQLite's missing file: tests/product/test_serve.py, and migrate creates it
def test_a_missing_database_is_one_line_naming_it_and_the_statement_that_creates_it(env, tmp_path):
    missing = with_database(env, "orbit_no_such_database")
    for command, args in commands(tmp_path).items():
        line = assert_one_line(
            orbit(missing, *args),
            command,
            'database "orbit_no_such_database" does not exist on ',
            "create it (CREATE DATABASE `orbit_no_such_database` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci)",
            "ORBIT_MYSQL_DSN",
        )
        assert line.count("\n") == 0
    assert not (tmp_path / "creds.json").exists()


def test_an_unreachable_database_server_is_one_line(env, tmp_path):
    port = closed_port()
    unreachable = {**env, "ORBIT_MYSQL_DSN": f"mysql://root:@127.0.0.1:{port}/orbit"}
    for command, args in commands(tmp_path).items():
        assert_one_line(
            orbit(unreachable, *args),
            command,
            f"cannot reach the database server at 127.0.0.1:{port}",
            "start it, or set ORBIT_MYSQL_DSN",
        )


@pytest.mark.mysql_only  # SQLite has no server to refuse a password
def test_refused_credentials_are_one_line_without_the_password(env, tmp_path):
    settings = database_settings()  # the default database's (with cells, the directory's)
    dsn = f"mysql://orbit_nobody:s3cret-pw@{settings['HOST']}:{settings['PORT']}/{settings['NAME']}"
    for command, args in commands(tmp_path).items():
        result = orbit({**env, "ORBIT_MYSQL_DSN": dsn}, *args)
        assert_one_line(result, command, "refused the credentials", "check the user and password in ORBIT_MYSQL_DSN")
        assert "s3cret-pw" not in result.stderr + result.stdout


def test_a_database_never_migrated_is_one_line_saying_run_migrate(env, empty_database, tmp_path):
    if connection.vendor == "sqlite":
        env = {**env, "ORBIT_SQLITE_PATH": empty_database["NAME"]}
    else:
        env = with_database(env, empty_database["NAME"])
    for command in ("orbit_check", "orbit_bootstrap", "serve"):
        assert_one_line(orbit(env, *commands(tmp_path)[command]), command, "migrations not applied", "orbit migrate")


@pytest.mark.mysql_only
def test_orbit_cells_reports_a_database_that_does_not_answer_and_exits_1(env):
    """A status report a monitor runs: the report on stdout, and the status says
    whether the installation answers."""
    result = orbit(with_database(one_database(env), "orbit_no_such_database"), "orbit_cells")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "unreachable: OperationalError" in result.stdout and "Unknown database" in result.stdout
    assert result.stderr == "CommandError: the database does not answer\n"
    assert orbit(env, "orbit_cells").returncode == 0


@pytest.mark.mysql_only
def test_traceback_asks_for_the_traceback(env):
    result = orbit(with_database(env, "orbit_no_such_database"), "migrate", "--traceback")
    assert result.returncode == 1 and "Traceback" in result.stderr
    assert "Unknown database 'orbit_no_such_database'" in result.stderr


def test_other_errors_are_reported_as_before(env, tmp_path):
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    result = orbit(env, "orbit_bootstrap", *BOOTSTRAP, "--output", str(taken))
    assert result.returncode == 1
    assert result.stderr == f"CommandError: {taken} already exists; pass --overwrite to replace it\n"
    unknown = orbit(env, "no_such_command")
    assert unknown.returncode == 1 and "Unknown command: 'no_such_command'" in unknown.stderr


def bootstrap_url(env: dict[str, str], tmp_path: Path, *args: str) -> str:
    output = tmp_path / f"creds-{len(list(tmp_path.iterdir()))}.json"
    result = orbit(env, "orbit_bootstrap", *BOOTSTRAP, "--output", str(output), *args)
    assert result.returncode == 0, result.stderr
    return str(json.loads(output.read_text())["url"])


@pytest.mark.django_db(transaction=True)  # the subprocess's rows are flushed after
def test_the_credentials_files_url_is_url_then_orbit_url_then_orbit_http_addr(env, tmp_path):
    assert bootstrap_url(env, tmp_path) == "http://127.0.0.1:8080"
    served = {**env, "ORBIT_HTTP_ADDR": "127.0.0.1:9123"}  # as `orbit serve` then serves without -b/-p
    assert bootstrap_url(served, tmp_path) == "http://127.0.0.1:9123"
    assert bootstrap_url({**served, "ORBIT_URL": "https://orbit.example"}, tmp_path) == "https://orbit.example"
    given = bootstrap_url({**served, "ORBIT_URL": "https://orbit.example"}, tmp_path, "--url", "http://10.0.0.5:9000")
    assert given == "http://10.0.0.5:9000"


@pytest.mark.django_db(transaction=True)  # the subprocess's rows are flushed after
def test_a_url_no_client_can_use_is_refused_before_anything_is_minted(env, tmp_path):
    output = tmp_path / "creds.json"
    result = orbit(env, "orbit_bootstrap", *BOOTSTRAP, "--output", str(output), "--url", "127.0.0.1:9000")
    assert result.returncode == 1 and result.stderr.startswith("CommandError: --url: must be an http:// or https://")
    assert not output.exists()
    created = orbit(env, "orbit_credential", "create", *BOOTSTRAP[:6], "--scopes", "tasks:read", "--queues", "all")
    assert created.returncode == 2  # argparse: --output is required, nothing else changed
    made = tmp_path / "more.json"
    bootstrap_url(env, tmp_path)
    credential = orbit(
        env,
        "orbit_credential",
        "create",
        *BOOTSTRAP[:6],
        "--scopes",
        "tasks:read",
        "--queues",
        "all",
        "--output",
        str(made),
        "--url",
        "https://orbit.internal:8443",
    )
    assert credential.returncode == 0, credential.stderr
    assert json.loads(made.read_text())["url"] == "https://orbit.internal:8443"


def test_help_lists_serve_among_the_commands_and_explains_it(env):
    listing = orbit(env, "help")
    assert listing.returncode == 0, listing.stderr
    server = listing.stdout.split("[server]\n", 1)[1].split("\n\n", 1)[0].split()
    assert server == [
        "migrate",
        "orbit_application",
        "orbit_bootstrap",
        "orbit_cells",
        "orbit_credential",
        "orbit_move_application",
        "serve",
    ], listing.stdout
    assert listing.stdout.count("[server]") == 1
    serve_help = orbit(env, "help", "serve")
    assert serve_help.returncode == 0 and "--processes N" in serve_help.stdout, serve_help.stderr
    assert orbit(env, "serve", "--help").stdout == serve_help.stdout


def test_an_argument_that_is_not_utf8_is_one_line_not_a_traceback(env):
    result = orbit(env, "orbit_application", "create", b"app-\xff")
    assert result.returncode == 1 and result.stderr == "manage.py: argument 'app-\\xff' is not valid UTF-8\n"


@pytest.mark.parametrize("url", ["http://[::1", "http://orbit:99999", "http://orbit:port"])
def test_a_url_python_cannot_parse_is_refused_as_any_unusable_url(env, tmp_path, url):
    output = tmp_path / "creds.json"
    result = orbit(env, "orbit_bootstrap", *BOOTSTRAP, "--output", str(output), "--url", url)
    assert result.returncode == 1, result.stderr
    assert result.stderr == f"CommandError: --url: must be an http:// or https:// URL with a host, not {url!r}\n"
    assert not output.exists()


@pytest.mark.parametrize(
    ("dsn", "why"),
    [
        ("mysql://root:@127.0.0.1:3306/", ": it names no database"),
        ("mysql://root:@127.0.0.1:3306", ": it names no database"),
        ("mysql://root:@127.0.0.1:abc/orbit", " (Port could not be cast to integer value as 'abc')"),
        ("mysql://root:@127.0.0.1:70000/orbit", " (Port out of range 0-65535)"),
    ],
)
def test_a_dsn_orbit_cannot_use_is_a_configuration_error_naming_the_variable(env, dsn, why):
    for command in ("migrate", "orbit_check"):
        result = orbit({**env, "ORBIT_MYSQL_DSN": dsn}, command)
        assert result.returncode == 1, result.stderr
        form = "ORBIT_MYSQL_DSN must look like mysql://user:pass@host:port/db"
        assert result.stderr == f"manage.py: configuration error: {form}{why}\n"


def test_an_sqlite_file_in_a_missing_directory_is_one_line_for_migrate_and_check(env, tmp_path):
    path = tmp_path / "missing" / "orbit.sqlite3"
    sqlite = {name: value for name, value in one_database(env).items() if name != "ORBIT_MYSQL_DSN"}
    sqlite["ORBIT_SQLITE_PATH"] = str(path)
    for command in ("migrate", "orbit_check"):
        result = orbit(sqlite, command)
        line = assert_one_line(result, command, f"database file {path} cannot be created")
        advice = "(create it, or set ORBIT_SQLITE_PATH to a file in one that does)"
        assert line.endswith(f"its directory {path.parent} does not exist {advice}")
    assert not path.parent.exists()


def test_overwrite_never_writes_through_a_link_or_into_a_device(env, tmp_path):
    """--overwrite truncated and chmod-ed whatever the path named: /dev/null became 0600."""
    real = tmp_path / "real.json"
    real.write_text("keep")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    for output in (str(link), "/dev/null"):
        result = orbit(env, "orbit_bootstrap", *BOOTSTRAP, "--output", output, "--overwrite")
        assert result.returncode == 1, result.stderr
        assert result.stderr == f"CommandError: --output: {output} is not a regular file (a link or a device)\n"
    assert real.read_text() == "keep"
    assert Path("/dev/null").stat().st_mode & 0o777 == 0o666

"""The `orbit` command of an installed server (and of manage.py in the repo).

`orbit <command>` is Django's management command line with Orbit's settings:
`orbit migrate`, `orbit orbit_bootstrap ...`, `orbit orbit_check`, `orbit help`.
`orbit serve [-b HOST] [-p PORT] [--processes N] [daphne's options]` runs the
server as `python -m orbit.serve -b HOST -p PORT orbit.asgi:application` does,
after checking that it can serve: the database answers and has every migration.
With N above 1 (the default: the number of cores) a supervisor binds the
address and runs N such processes on it (server/supervisor.py); `--processes 1`
serves in this process. It prints one start-up line on stdout; a problem is one
line on stderr and exit status 1.

Every other command that cannot use the database (missing, unreachable, the
credentials refused, or never migrated) also says so in one line on stderr,
naming the database and what to do, and exits 1: `orbit migrate: database
"orbit" does not exist on 127.0.0.1:3306; create it (CREATE DATABASE ...)`.
Other errors are reported as Django reports them (`--traceback` shows the
traceback of a database error too)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from server import supervisor

SETTINGS_MODULE = "server.settings"
DEFAULT_HTTP_ADDR = "127.0.0.1:8080"
APPLICATION = "server.asgi:application"
# The start-up check waits this long for the database: a production server
# may be slow to accept right after it started, unlike a 1 s readiness poll.
STARTUP_DB_SECONDS = 5.0
# The line server.probes.explain() writes for an error it cannot name a cause of.
UNNAMED_DATABASE_ERROR = "database error: "

# Set by main() for `orbit <command>`: the commands that turn database errors
# into a CommandError of their own (orbit_bootstrap, orbit_credential) then
# raise DatabaseUnusable instead, so every command says it the same way;
# called from Python (call_command) they keep raising their CommandError.
_reporting_database_errors = False


class DatabaseUnusable(Exception):  # noqa: N818 - what it says, like Django's ImproperlyConfigured
    """The database cannot be used; the message is the one line to print."""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", SETTINGS_MODULE)
    if len(argv) > 1 and argv[1] == "serve":
        sys.exit(serve(argv[2:]))
    problem = argument_problem(argv[1:]) or settings_problem()
    if problem is not None:
        sys.exit(f"{os.path.basename(argv[0])}: {problem}")
    if argv[1:3] == ["help", "serve"]:
        # serve's options are its own parser's (management/commands/serve.py only lists it).
        sys.exit(serve(["--help"]))
    make_local_dir()
    status = run_command(argv)
    if status:  # a command that succeeds returns, as Django's command line does
        sys.exit(status)


def run_command(argv: list[str]) -> int:
    """Django's command line, with a database it cannot use said in one line."""
    global _reporting_database_errors
    from django.core.management import execute_from_command_line
    from django.db import DatabaseError

    from orbit.cells import UnknownCell

    command = argv[1] if len(argv) > 1 else "help"
    prefix = f"{os.path.basename(argv[0])} {command}"
    wants_traceback = "--traceback" in argv
    _reporting_database_errors = not wants_traceback
    try:
        execute_from_command_line(argv)
    except (DatabaseUnusable, UnknownCell) as exc:
        print(f"{prefix}: {exc.args[0]}", file=sys.stderr, flush=True)
        return 1
    except DatabaseError as exc:
        problem = None if wants_traceback else database_problem(exc, migrating=command == "migrate")
        if problem is None:
            raise
        print(f"{prefix}: {problem}", file=sys.stderr, flush=True)
        return 1
    finally:
        _reporting_database_errors = False
    return 0


def reporting_database_errors() -> bool:
    """True while main() runs a command (see _reporting_database_errors)."""
    return _reporting_database_errors


def database_problem(exc: BaseException, *, migrating: bool = False) -> str | None:
    """The one line for a command's database error when the cause is the
    database itself (missing, unreachable, credentials refused, or never
    migrated), or None for any other error (a bug, a lock wait, bad data).
    With cells, the first database of the installation found at fault (the
    directory, then each cell), named by its setting."""
    from orbit import cells
    from server.probes import check_database, database_settings, explain, installation_databases, missing_directory

    if cells.configured():
        for setting, database in installation_databases():
            found = check_database(database, timeout=STARTUP_DB_SECONDS, migrations=not migrating)
            if found is not None and not found.startswith(UNNAMED_DATABASE_ERROR):
                return with_advice(found, database, setting)
        # Every database answers now: a connection broke under a statement (a cell frozen
        # for a while, a failover), or the error is none of the database's.
        return connection_lost(exc)
    database = database_settings()
    unmakeable = missing_directory(database)
    if unmakeable is not None:
        return unmakeable
    line = explain(exc, database)
    if not line.startswith(UNNAMED_DATABASE_ERROR):
        return with_advice(line, database)
    if migrating:
        return None  # migrate's own error: pending migrations are what it applies
    # e.g. "no such table" from a database that was never migrated: ask the start-up check.
    found = check_database(database, timeout=STARTUP_DB_SECONDS)
    if found is None or found.startswith(UNNAMED_DATABASE_ERROR):
        return None
    return with_advice(found, database)


# The MySQL client's codes for a connection that broke under a statement: the
# server went away, stopped answering, or was frozen past the read timeout.
CONNECTION_LOST_CODES = frozenset({2006, 2013, 4031})


def connection_lost(exc: BaseException) -> str | None:
    """The one line for a connection that broke mid-command, when the database
    answers again by the time it is explained."""
    from django.db import OperationalError

    if isinstance(exc, OperationalError) and exc.args and exc.args[0] in CONNECTION_LOST_CODES:
        said = exc.args[1] if len(exc.args) > 1 else exc.args[0]
        return f"lost its database connection ({said}); run it again"
    return None


def with_advice(problem: str, database: dict[str, Any], setting: str = "ORBIT_MYSQL_DSN") -> str:
    """server.probes' one-line reason, with what the operator can do about it
    (`setting`: what names that database)."""
    name = database["NAME"]
    if "does not exist on " in problem:
        return f"{problem}; create it ({create_database_sql(database)}) or set {setting} to another"
    if "refused the credentials" in problem:
        return f"{problem}; check the user and password in {setting} and the user's GRANT on `{name}`.*"
    if "cannot reach the database server" in problem:
        return f"{problem}; start it, or set {setting} to a server that runs"
    return problem  # the others say what to do already (`orbit migrate`)


def create_database_sql(database: dict[str, Any]) -> str:
    """The statement README's Production gives, with the settings' TEST character
    set and collation: the ones the test suite runs on."""
    test = database.get("TEST") or {}
    collation = test.get("COLLATION")
    return f"CREATE DATABASE `{database['NAME']}` CHARACTER SET {test.get('CHARSET') or 'utf8mb4'}" + (
        f" COLLATE {collation}" if collation else ""
    )


def argument_problem(arguments: list[str]) -> str | None:
    """An argument that is not UTF-8 (the bytes Python decodes to lone
    surrogates), said in one line: every name and key is compared as UTF-8,
    and the database driver would fail on it with a traceback."""
    for argument in arguments:
        try:
            argument.encode("utf-8")
        except UnicodeEncodeError:
            shown = argument.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            return f"argument '{shown}' is not valid UTF-8"
    return None


def settings_problem() -> str | None:
    """A configuration error (a malformed ORBIT_MYSQL_DSN) as one line, not
    the traceback Django would print from inside its settings import."""
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    try:
        settings.INSTALLED_APPS  # noqa: B018 - importing the settings module is the check
    except (ImproperlyConfigured, ValueError) as exc:
        return f"configuration error: {exc}"
    return None


def make_local_dir(engine: str | None = None, local_dir: Path | None = None) -> None:
    """The default SQLite file's directory (.local/), so that `orbit migrate`
    can create the file there, as scripts/run's mkdir does in the repo. Only
    for the default path: a path given in ORBIT_SQLITE_PATH is the user's."""
    from django.conf import settings

    engine = settings.DATABASES["default"]["ENGINE"] if engine is None else engine
    if "sqlite" in engine and not os.environ.get("ORBIT_SQLITE_PATH"):
        (settings.LOCAL_DIR if local_dir is None else local_dir).mkdir(mode=0o700, exist_ok=True)


def split_addr(addr: str) -> tuple[str, int]:
    """ORBIT_HTTP_ADDR's host and port: `host:port`, or `[v6]:port`."""
    host, sep, port = addr.strip().rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()):
        raise ValueError(f"ORBIT_HTTP_ADDR must look like HOST:PORT, not {addr!r}")
    return host.strip("[]"), int(port)


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orbit serve",
        description="Serve Orbit's HTTP API and worker protocol (daphne on uvloop). "
        "Other options are daphne's (see `daphne --help`), e.g. --access-log FILE.",
    )
    parser.add_argument("-b", "--bind", metavar="HOST", help="address to listen on (default: ORBIT_HTTP_ADDR's host)")
    parser.add_argument("-p", "--port", type=int, help="port to listen on (default: ORBIT_HTTP_ADDR's port)")
    parser.add_argument(
        "--processes",
        type=supervisor.positive,
        default=supervisor.default_processes(),
        metavar="N",
        help="server processes on the address (default: the number of cores, here %(default)s); "
        "1 serves in this process",
    )
    return parser


def serve(args: list[str]) -> int:
    options, daphne_args = serve_parser().parse_known_args(args)
    try:
        default_host, default_port = split_addr(os.environ.get("ORBIT_HTTP_ADDR") or DEFAULT_HTTP_ADDR)
    except ValueError as exc:
        return fail(str(exc))
    host = options.bind or default_host
    port = default_port if options.port is None else options.port

    # Before Django's setup imports daphne (INSTALLED_APPS), which makes its
    # event loop on import: server.serve sets uvloop's policy first.
    from server import serve as server

    problem = settings_problem()
    if problem is not None:
        return fail(problem)
    import django

    django.setup()
    from django.conf import settings

    from server.probes import check_database, describe_installation, installation_databases, one_database_twice

    if settings.ORBIT_DEVELOPMENT_SECRET_KEY:
        print(
            "orbit serve: warning: ORBIT_SECRET_KEY is not set, so the public development secret key signs "
            "sessions and admin logins; set ORBIT_SECRET_KEY to a long random value",
            file=sys.stderr,
            flush=True,
        )
    for setting, database in installation_databases():  # with cells: the directory, then each cell
        problem = check_database(database, timeout=STARTUP_DB_SECONDS)
        if problem is not None:
            return fail(with_advice(problem, database, setting))
    problem = one_database_twice(installation_databases(), timeout=STARTUP_DB_SECONDS)
    if problem is not None:
        return fail(problem)
    described = describe_installation()

    def announce(addresses: list[tuple[str, int]]) -> None:
        print(supervisor.announce_line(addresses, options.processes, described), flush=True)

    if options.processes == 1:
        server.stop_on_hangup()
        return server.run(
            ["-b", host, "-p", str(port), *daphne_args, APPLICATION], on_listening=announce, on_listen_failure=fail
        )
    problem = supervisor.endpoint_problem(daphne_args)
    if problem is not None:
        return fail(problem)
    try:
        sock = supervisor.listen(host, port)
    except supervisor.ListenError as exc:
        return fail(str(exc))
    from django.db import connections

    connections.close_all()  # the children open their own
    addresses = [sock.getsockname()[:2]]
    with sock:
        return supervisor.Supervisor(sock, options.processes, [*daphne_args, APPLICATION]).run(
            on_ready=lambda: announce(addresses)
        )


def fail(message: str) -> int:
    print(f"orbit serve: {message}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    main()

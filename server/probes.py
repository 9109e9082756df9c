"""Unauthenticated probes: GET /healthz (the process answers) and GET /readyz
(the database answers within 1 s and every migration is applied), plus the
database check `orbit serve` runs before it listens.

Both probes are polled every second by orchestrators, so they stay cheap:
/healthz touches nothing, /readyz sends one `SELECT 1` once the migrations
have been seen applied (that result is kept: migrations are not un-applied
under a running server, and reading the migration graph each second would
cost far more than the query).

The 1 s bound holds even against a frozen database server (one that accepts
connections and never answers): the check runs on a thread of its own, on a
connection of its own with short client timeouts, and the request waits for
it at most PROBE_SECONDS. Polls that arrive while a check is still running
wait on that same check instead of starting another, so a frozen server
costs one stuck thread, not one per poll.

/readyz is read without a credential, so its 503 names no detail of the
database (a driver's error names its user, host, port and database): it says
"database unreachable", or that migrations are pending, and the detail goes
to the server log at WARNING, once each time it changes."""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import Any

from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import load_backend
from django.http import HttpRequest, HttpResponse, JsonResponse

from orbit import cells
from orbit.api.errors import COMPACT_JSON, error_body
from orbit.api.middleware import request_id_of

PROBE_SECONDS = 1.0
# What /readyz says, without a credential, for any reason the database could not be checked.
UNREACHABLE = "database unreachable"

logger = logging.getLogger(__name__)

# MySQL client error numbers, for a reason an operator can act on.
_UNKNOWN_DATABASE = 1049
_ACCESS_DENIED = frozenset({1044, 1045, 1698})
_UNREACHABLE = frozenset({2002, 2003, 2005, 2006, 2013, 2055})


def database_settings(alias: str = "default") -> dict[str, Any]:
    """The alias's current settings (pytest-django renames NAME to the test
    database on this very dict), copied so a probe's changes stay its own;
    the default alias's are the default database's (with cells, the
    directory's) whatever cell is entered."""
    with cells.in_cell(None):
        return copy.deepcopy(connections[alias].settings_dict)


def installation_databases() -> list[tuple[str, dict[str, Any]]]:
    """Every database of the installation, each with the setting that names
    it: the default database (ORBIT_MYSQL_DSN; with cells, the directory),
    then each cell's (ORBIT_CELLS["a"], …)."""
    return [
        ("ORBIT_MYSQL_DSN", database_settings()),
        *((f'ORBIT_CELLS["{cell}"]', database_settings(cells.alias_of(cell))) for cell in cells.names()),
    ]


def describe_installation() -> str:
    """describe_database of the default database, and with cells each cell's."""
    (_, directory), *in_cells = installation_databases()
    described = describe_database(directory)
    if not in_cells:
        return described
    listed = ", ".join(
        f"{cell}: {describe_database(settings)}" for cell, (_, settings) in zip(cells.names(), in_cells, strict=True)
    )
    return f"{described}, cells {listed}"


def describe_database(settings_dict: dict[str, Any]) -> str:
    """`mysql "orbit" at db:3306` / `sqlite /srv/orbit.sqlite3`: no password."""
    vendor = _vendor(settings_dict)
    if vendor == "sqlite":
        return f"sqlite {settings_dict['NAME']}"
    return f'{vendor} "{settings_dict["NAME"]}" at {_server(settings_dict)}'


def _vendor(settings_dict: dict[str, Any]) -> str:
    engine = settings_dict["ENGINE"]
    if "sqlite" in engine:
        return "sqlite"
    if "mysql" in engine:
        return "mysql"
    return engine.rsplit(".", 1)[-1]


def _server(settings_dict: dict[str, Any]) -> str:
    return f"{settings_dict.get('HOST') or '127.0.0.1'}:{settings_dict.get('PORT') or 3306}"


def open_connection(settings_dict: dict[str, Any], timeout: float) -> BaseDatabaseWrapper:
    """A connection of its own (not the thread's `django.db.connection`), with
    client timeouts of `timeout` seconds on MySQL: the server's settings keep
    30 s read timeouts for queries that may wait on row locks; a probe's
    `SELECT 1` waits on nothing."""
    settings_dict = copy.deepcopy(settings_dict)
    settings_dict["CONN_MAX_AGE"] = None  # a probe keeps its one connection
    backend = load_backend(settings_dict["ENGINE"])
    wrapper = backend.DatabaseWrapper(settings_dict, "default")
    if _vendor(settings_dict) == "mysql":
        seconds = max(1, math.ceil(timeout))  # the driver takes whole seconds
        timeouts = {"connect_timeout": seconds, "read_timeout": seconds, "write_timeout": seconds}
        backend_params = wrapper.get_connection_params

        # Applied after the backend's own parameters: in a serving process
        # Orbit's backend sets its serving timeouts (seconds longer) on every
        # connection it opens, over the settings' OPTIONS.
        def connection_params() -> dict[str, Any]:
            return {**backend_params(), **timeouts}

        wrapper.get_connection_params = connection_params
    return wrapper


def unapplied_migrations(connection: BaseDatabaseWrapper) -> list[str]:
    """`app.migration` names the code has and the database has not applied, in order."""
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    return [f"{migration.app_label}.{migration.name}" for migration, _backwards in plan]


def _not_found(settings_dict: dict[str, Any]) -> str | None:
    """SQLite creates a missing file on connect; a probe must not (an empty
    file would then look like a database with no migrations)."""
    path = _sqlite_file(settings_dict)
    if path is None:
        return None
    unmakeable = missing_directory(settings_dict)
    if unmakeable is not None:
        return unmakeable
    if not path.is_file():
        return f"database file {path} does not exist (run `orbit migrate` to create it)"
    return None


def missing_directory(settings_dict: dict[str, Any]) -> str | None:
    """An SQLite file whose directory does not exist: `orbit migrate` cannot
    create it there either (the directory of a path the user gave is theirs to make)."""
    path = _sqlite_file(settings_dict)
    if path is None or path.parent.is_dir():
        return None
    return (
        f"database file {path} cannot be created: its directory {path.parent} does not exist"
        " (create it, or set ORBIT_SQLITE_PATH to a file in one that does)"
    )


def _sqlite_file(settings_dict: dict[str, Any]) -> Path | None:
    """The file of an SQLite database; None for another vendor, `:memory:` or a `file:` URI."""
    name = str(settings_dict["NAME"])
    if _vendor(settings_dict) != "sqlite" or name == ":memory:" or name.startswith("file:"):
        return None
    return Path(name)


def explain(exc: BaseException, settings_dict: dict[str, Any]) -> str:
    """One line an operator can act on, for an error reaching the database."""
    errno = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
    detail = str(exc.args[1] if errno is not None and len(exc.args) > 1 else exc).splitlines()[0]
    if errno == _UNKNOWN_DATABASE:
        return f'database "{settings_dict["NAME"]}" does not exist on {_server(settings_dict)}'
    if errno in _ACCESS_DENIED:
        return f"the database server at {_server(settings_dict)} refused the credentials: {detail}"
    if errno in _UNREACHABLE:
        return f"cannot reach the database server at {_server(settings_dict)}: {detail}"
    return f"database error: {detail}"


@dataclass(frozen=True)
class NotReady:
    """Why the database is not ready: `public` for anyone who asks (/readyz),
    `detail` for the operator (the server log, `orbit serve`'s start-up check)."""

    public: str
    detail: str


def examine(connection: BaseDatabaseWrapper, *, migrations: bool = True) -> NotReady | None:
    """Why the database is not ready on `connection`, or None when it is."""
    missing = _not_found(connection.settings_dict)
    if missing is not None:
        return NotReady(UNREACHABLE, missing)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
        pending = unapplied_migrations(connection) if migrations else []
    except DatabaseError as exc:
        return NotReady(UNREACHABLE, explain(exc, connection.settings_dict))
    if pending:
        count = f"{len(pending)} migration{'s' if len(pending) != 1 else ''}"
        return NotReady(
            f"{count} not applied; run `orbit migrate`",
            f"{count} not applied (first: {pending[0]}); run `orbit migrate`",
        )
    return None


def diagnose(connection: BaseDatabaseWrapper, *, migrations: bool = True) -> str | None:
    """The operator's reason the database is not ready on `connection`, or None."""
    found = examine(connection, migrations=migrations)
    return None if found is None else found.detail


@contextmanager
def probe_connection(settings_dict: dict[str, Any], timeout: float) -> Iterator[BaseDatabaseWrapper]:
    """open_connection for one probe, closed after it. Used outside any cell a command has
    entered: inside one, the check of another database (the directory's, when a cell
    failed) reached the entered cell's instead."""
    connection = open_connection(settings_dict, timeout)
    with cells.in_cell(None):
        try:
            yield connection
        finally:
            try:
                connection.close()
            except DatabaseError:  # a connection that never opened has nothing to close
                pass


def check_database(
    settings_dict: dict[str, Any] | None = None, timeout: float = 5.0, *, migrations: bool = True
) -> str | None:
    """Start-up check of `orbit serve`, on a connection it closes again
    (`migrations`: pending ones count as a problem)."""
    settings_dict = database_settings() if settings_dict is None else settings_dict
    with probe_connection(settings_dict, timeout) as connection:
        return diagnose(connection, migrations=migrations)


def one_database_twice(databases: list[tuple[str, dict[str, Any]]], timeout: float = 5.0) -> str | None:
    """Two settings of the installation that reach one database by different names (a
    host as localhost and as 127.0.0.1, say), which settings cannot see: each database
    asked which server and schema it is. None when all differ, or when one does not
    answer (check_database says so)."""
    seen: dict[tuple[Any, ...], str] = {}
    for setting, settings_dict in databases:
        if _vendor(settings_dict) != "mysql":
            continue
        try:
            with probe_connection(settings_dict, timeout) as connection, connection.cursor() as cursor:
                cursor.execute("SELECT @@hostname, @@port, @@datadir, DATABASE()")
                identity = tuple(cursor.fetchone())
        except DatabaseError:
            return None
        if identity in seen:
            return f"{setting} is the same database as {seen[identity]} (one server, reached by two names)"
        seen[identity] = setting
    return None


class Readiness:
    """The /readyz check: one at a time, on one thread and one kept connection."""

    def __init__(self, settings_dict: dict[str, Any] | None = None, timeout: float = PROBE_SECONDS) -> None:
        self.settings_dict = settings_dict  # None: the default database's, when first checked
        self.timeout = timeout
        self.migrated = False  # kept once true (see the module's docstring)
        self._lock = threading.Lock()
        self._running: Future[NotReady | None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orbit-readyz")
        self._connection: BaseDatabaseWrapper | None = None  # used on the executor's thread only
        self._logged: str | None = None  # the detail last written to the log

    def start(self) -> Future[NotReady | None]:
        """The check under way, or a new one: never two at once."""
        with self._lock:
            if self._running is None or self._running.done():
                self._running = self._executor.submit(self._check)
            return self._running

    def _check(self) -> NotReady | None:
        if self.settings_dict is None:
            self.settings_dict = database_settings()
        kept = self._connection is not None
        found = self._check_once()
        if found is not None and kept:
            # The kept connection may be what broke (the server restarted
            # since the last poll): one more try, on a new connection.
            found = self._check_once()
        return found

    def _check_once(self) -> NotReady | None:
        assert self.settings_dict is not None
        if self._connection is None:
            self._connection = open_connection(self.settings_dict, self.timeout)
        try:
            found = examine(self._connection, migrations=not self.migrated)
        except Exception as exc:  # noqa: BLE001 - a probe answers 503, it does not raise
            found = NotReady(UNREACHABLE, f"readiness check failed: {exc}")
        if found is None:
            self.migrated = True
        else:
            try:
                self._connection.close()
            except Exception:  # noqa: BLE001,S110 - closing a dead connection may fail too
                pass
            self._connection = None
        return found

    async def reason(self) -> NotReady | None:
        """Why the server is not ready, or None; within `timeout` seconds."""
        running = asyncio.wrap_future(self.start())
        # wait(), not wait_for(): a timeout must not cancel the check others share.
        done, _ = await asyncio.wait({running}, timeout=self.timeout)
        if not done:
            return NotReady(UNREACHABLE, f"the database did not answer within {self.timeout:g} s")
        return running.result()

    def log(self, found: NotReady | None) -> None:
        """The detail to the server log at WARNING, once each time it changes:
        orchestrators poll every second, and a database down for an hour is
        one line, not 3,600."""
        detail = None if found is None else found.detail
        if detail is not None and detail != self._logged:
            logger.warning("/readyz: not ready: %s", detail)
        self._logged = detail


READINESS = Readiness()
# With cells: one check per cell, each on its own thread and connection.
_CELL_READINESS: dict[str, Readiness] = {}


def _cell_readiness(cell: str) -> Readiness:
    if cell not in _CELL_READINESS:
        _CELL_READINESS[cell] = Readiness(database_settings(cells.alias_of(cell)))
    return _CELL_READINESS[cell]


async def _cell_states() -> dict[str, str]:
    """Each cell's state for /readyz: "ready", or its public reason."""
    names = cells.names()
    found = await asyncio.gather(*(_cell_readiness(cell).reason() for cell in names))
    states = {}
    for cell, reason in zip(names, found, strict=True):
        _cell_readiness(cell).log(reason)
        states[cell] = "ready" if reason is None else reason.public
    return states


def _no_store(response: JsonResponse) -> JsonResponse:
    response["Cache-Control"] = "no-store"
    return response


def read_only(
    view: Callable[[HttpRequest], Coroutine[Any, Any, HttpResponse]],
) -> Callable[[HttpRequest], Coroutine[Any, Any, HttpResponse]]:
    """`view` for GET and HEAD; any other method 405 in the error envelope, as
    every /v1 route answers it (a probe that says 200 to a POST tells a
    misconfigured client nothing)."""

    @wraps(view)
    async def guarded(request: HttpRequest) -> HttpResponse:
        if request.method in ("GET", "HEAD"):
            return await view(request)
        return method_not_allowed(request)

    return guarded


def method_not_allowed(request: HttpRequest) -> JsonResponse:
    body = error_body(request_id_of(request), "INVALID_ARGUMENT", f'Method "{request.method}" not allowed.')
    response = JsonResponse(body, status=405, json_dumps_params=COMPACT_JSON)
    response["Allow"] = "GET, HEAD"
    return response


@read_only
async def healthz(request: HttpRequest) -> JsonResponse:
    """GET /healthz: the process answers. No credential, no database."""
    body = {"request_id": request_id_of(request), "data": {"status": "ok"}}
    return _no_store(JsonResponse(body, json_dumps_params=COMPACT_JSON))


@read_only
async def readyz(request: HttpRequest) -> JsonResponse:
    """GET /readyz: 200 when the database answers within 1 s with every
    migration applied; else 503 UNAVAILABLE with the public reason (the
    detail in the server log). No credential. With cells the database is
    the directory, and the 200's `cells` gives each cell's state ("ready",
    or its reason): a cell that is down confines its outage to its
    applications, so it does not make the node unready."""
    if cells.configured():
        found, states = await asyncio.gather(READINESS.reason(), _cell_states())
    else:
        found, states = await READINESS.reason(), None
    READINESS.log(found)
    if found is None:
        data: dict[str, Any] = {"status": "ready"} if states is None else {"status": "ready", "cells": states}
        body: dict[str, Any] = {"request_id": request_id_of(request), "data": data}
        return _no_store(JsonResponse(body, json_dumps_params=COMPACT_JSON))
    body = error_body(request_id_of(request), "UNAVAILABLE", f"not ready: {found.public}")
    unready = _no_store(JsonResponse(body, status=503, json_dumps_params=COMPACT_JSON))
    # Logged above once per change: Django's django.request line for each 5xx
    # would repeat it on every poll (a probe a second, an hour's outage).
    unready._has_been_logged = True  # type: ignore[attr-defined]  # django.utils.log.log_response's mark
    return unready

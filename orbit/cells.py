"""Cells: applications placed on several database primaries.

`ORBIT_CELLS` (JSON `{"NAME": "mysql://…", …}`) names the cells. The default
database (`ORBIT_MYSQL_DSN`) is then the directory: which cell holds each
application (CellPlacement) and which application each credential belongs to
(CredentialPlacement). Every other row of an application lives in its cell.

Code reaches its application's cell without naming it: while a cell is
entered (`enter`, `in_cell`), the default connection alias is that cell's
connection, so the ORM, raw SQL on `django.db.connection` and
`transaction.atomic()` all run there. The directory's own models, and
Django's (auth, admin, sessions), are routed to the directory whatever is
entered. A cell is entered where an application becomes known: a credential
authenticated, a round's lane started, a worker connection's hello, a
maintenance pass over each cell.

Unset, there is one cell, the default database, no alias is rerouted and
nothing here is installed: today's behaviour exactly."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS
from django.db.utils import ConnectionHandler

# The directory's alias under cells: the default database, never rerouted.
DIRECTORY = "directory"
CELL_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# Django's own apps keep their rows (operators, sessions, admin log) in the directory.
DIRECTORY_APPS = frozenset({"admin", "auth", "contenttypes", "sessions"})
DIRECTORY_MODELS = frozenset({"cellplacement", "credentialplacement"})

# 503 UNAVAILABLE (Retry-After: 1) while an application moves, and from a
# node whose directory cache still named the old cell.
MOVING = "application is moving to another cell; retry shortly"
MOVED_AWAY = "application has moved to another cell; retry"

_entered: ContextVar[str | None] = ContextVar("orbit_cell", default=None)


class CellsMisconfigured(ValueError):
    """ORBIT_CELLS cannot be used as given; the message says why."""


def parse_cells(text: str | None) -> dict[str, str]:
    """The cells ORBIT_CELLS names, name to DSN, in its order; {} when unset or empty."""
    if text is None or not text.strip():
        return {}
    try:
        cells = json.loads(text)
    except ValueError as exc:
        raise CellsMisconfigured(f"ORBIT_CELLS must be a JSON object of cell names to mysql:// DSNs: {exc}") from None
    if not isinstance(cells, dict) or not cells:
        raise CellsMisconfigured("ORBIT_CELLS must be a non-empty JSON object of cell names to mysql:// DSNs")
    for name, dsn in cells.items():
        if not CELL_NAME.fullmatch(name):
            raise CellsMisconfigured(
                f"ORBIT_CELLS: cell name {name!r} must be 1-32 of a-z, 0-9, '_' and '-', starting with a letter"
            )
        if not isinstance(dsn, str) or not dsn.startswith("mysql://"):
            raise CellsMisconfigured(f"ORBIT_CELLS: cell {name!r} must be a mysql://user:pass@host:port/db DSN")
    return cells


def alias_of(cell: str) -> str:
    return f"cell_{cell}"


def named_by_alias(alias: str) -> str | None:
    """The cell whose database alias this is; None for the directory's."""
    return next((cell for cell in names() if alias_of(cell) == alias), None)


def configured() -> bool:
    return bool(getattr(settings, "ORBIT_CELLS", None))


def names() -> list[str]:
    """The configured cells, in ORBIT_CELLS's order ([] when unset)."""
    return list(getattr(settings, "ORBIT_CELLS", None) or ())


def entered() -> str | None:
    return _entered.get()


def enter(cell: str | None) -> None:
    """Enters `cell` for the rest of the current context (a pool call, a
    lane's thread, a connection's task); None leaves every cell."""
    if cell is not None and cell not in (getattr(settings, "ORBIT_CELLS", None) or {}):
        raise UnknownCell(cell)
    _entered.set(cell)


class UnknownCell(LookupError):
    """A cell the directory (or a caller) names that ORBIT_CELLS does not configure."""

    def __init__(self, cell: str) -> None:
        super().__init__(f"cell {cell!r} is not in ORBIT_CELLS, yet the directory places applications there")
        self.cell = cell


@contextmanager
def in_cell(cell: str | None) -> Iterator[None]:
    token = _entered.set(_entered.get())
    try:
        enter(cell)
        yield
    finally:
        _entered.reset(token)


class CellConnections(ConnectionHandler):
    """Django's connection handler, with the default alias rerouted to the
    entered cell's connection. The directory's alias is the default
    database's own connection, whatever is entered: one connection to the
    directory per thread, and the directory's writes inside a transaction
    opened on it (a test's, say) stay in that transaction."""

    def __getitem__(self, alias: str) -> Any:
        if alias == DEFAULT_DB_ALIAS:
            cell = _entered.get()
            if cell is not None:
                alias = alias_of(cell)
        elif alias == DIRECTORY:
            alias = DEFAULT_DB_ALIAS
        return super().__getitem__(alias)


class CellRouter:
    """The directory's models and Django's own go to the directory; an
    application's, to the default alias (the entered cell). Each database
    holds only its own tables, so a query that reached the wrong one fails
    loudly instead of reading an empty table."""

    @staticmethod
    def _in_directory(app_label: str, model_name: str | None) -> bool:
        return app_label in DIRECTORY_APPS or (app_label == "orbit" and model_name in DIRECTORY_MODELS)

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return DIRECTORY if self._in_directory(model._meta.app_label, model._meta.model_name) else None

    db_for_write = db_for_read

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool | None:
        return None

    def allow_migrate(self, db: str, app_label: str, model_name: str | None = None, **hints: Any) -> bool:
        if db == DIRECTORY:
            return False  # the same database as default: migrated under that alias
        if model_name is None:
            # A migration's RunPython/RunSQL without a model: wherever its app's tables are.
            return (db == DEFAULT_DB_ALIAS) == (app_label in DIRECTORY_APPS)
        return (db == DEFAULT_DB_ALIAS) == self._in_directory(app_label, model_name)


def install() -> None:
    """Reroutes django.db.connections (and with it django.db.connection and
    transaction.atomic()) when cells are configured; called once at start-up."""
    from django.db import connections

    if configured() and not isinstance(connections, CellConnections):
        connections.__class__ = CellConnections


# ---------------------------------------------------------------- the directory

_placements: dict[str, str] = {}
_credentials: dict[str, str] = {}
_cache_lock = threading.Lock()


def _read_through(cache: dict[str, str], key: str, read: Callable[[], str | None]) -> str | None:
    found = cache.get(key)
    if found is None:
        found = read()
        if found is not None:
            with _cache_lock:
                cache[key] = found
    return found


def cell_of_application(application_id: str) -> str | None:
    """The application's cell (cached: it changes only by a move, which
    forgets it here); None when unknown."""
    from orbit.models import CellPlacement

    return _read_through(
        _placements,
        application_id,
        lambda: CellPlacement.objects.filter(application_id=application_id).values_list("cell", flat=True).first(),
    )


def application_of_credential(credential_id: str) -> str | None:
    from orbit.models import CredentialPlacement

    return _read_through(
        _credentials,
        credential_id,
        lambda: (
            CredentialPlacement.objects.filter(credential_id=credential_id)
            .values_list("application_id", flat=True)
            .first()
        ),
    )


def cell_of_credential(credential_id: str) -> str | None:
    """The cell of the credential's application, from the directory (cached); None when unknown."""
    application_id = application_of_credential(credential_id)
    return None if application_id is None else cell_of_application(application_id)


def forget(application_id: str) -> None:
    """Drops the cached cell of an application that moved."""
    with _cache_lock:
        _placements.pop(application_id, None)


def enter_application(application_id: str) -> None:
    """Enters the application's cell (nothing when cells are not configured)."""
    if configured():
        cell = cell_of_application(application_id)
        if cell is None:
            raise LookupError(f"application {application_id} has no cell in the directory")
        enter(cell)


def enter_credential(credential_id: str) -> bool:
    """Enters the cell of the credential's application; False when the
    directory does not know the credential (it cannot authenticate)."""
    if not configured():
        return True
    application_id = application_of_credential(credential_id)
    if application_id is None:
        return False
    enter_application(application_id)
    return True


def known_cell_of_credential(credential_id: str) -> str | None:
    """On the event loop: the cell of a credential this process has looked
    up before, from memory alone; None for one it has not."""
    application_id = _credentials.get(credential_id)
    return None if application_id is None else _placements.get(application_id)


def enter_application_named(name: str) -> bool:
    """Enters the cell of the application called `name`; False when the
    directory does not know it (nothing when cells are not configured)."""
    if not configured():
        return True
    from orbit.models import CellPlacement

    cell = CellPlacement.objects.filter(name=name).values_list("cell", flat=True).first()
    if cell is None:
        return False
    enter(cell)
    return True


def each() -> list[str | None]:
    """What to enter, one after another, to visit every application: each
    cell, or None (no cell) when cells are not configured."""
    return list(names()) or [None]


def choose_cell(requested: str | None) -> str:
    """The cell a new application is placed in: `requested`, or the one
    with the fewest applications (the first of ORBIT_CELLS on a tie)."""
    from django.db.models import Count

    from orbit.models import CellPlacement

    cells = names()
    if requested is not None:
        if requested not in cells:
            raise LookupError(f"unknown cell {requested!r}; cells: {', '.join(cells)}")
        return requested
    counts = dict(
        CellPlacement.objects.values_list("cell").annotate(n=Count("application_id")).values_list("cell", "n")
    )
    return min(cells, key=lambda cell: (counts.get(cell, 0), cells.index(cell)))


def place_application(application_id: str, name: str, cell: str) -> None:
    from orbit.models import CellPlacement

    CellPlacement.objects.get_or_create(application_id=application_id, defaults={"name": name, "cell": cell})
    with _cache_lock:
        _placements[application_id] = cell


def place_credential(credential_id: str, application_id: str) -> None:
    from orbit.models import CredentialPlacement

    CredentialPlacement.objects.get_or_create(credential_id=credential_id, defaults={"application_id": application_id})

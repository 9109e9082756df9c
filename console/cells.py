"""The console across cells: each console request runs in one cell, the
operator's choice (a picker on every page, kept in the session), and a task's
page found by its id in whichever cell holds it. Without ORBIT_CELLS nothing
here does anything."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render

from orbit import cells
from orbit.api.errors import translate
from orbit.errors import Unavailable

SESSION_KEY = "orbit_cell"
PICK = "cell"
# A page of one row by its id, found in any cell: the task, the attempt.
_ROW_PAGE = re.compile(r"^/admin/tasks/(task|attempt)/([0-9a-f]{32})/change/$")


def _holds(kind: str, row_id: str) -> bool:
    from tasks.models import Attempt, Task

    return (Task if kind == "task" else Attempt).objects.filter(id=row_id).exists()


def _cell_holding(kind: str, row_id: str, first: str) -> str:
    """The cell that holds the row, `first` looked in first (and kept when none does);
    a cell that does not answer is passed over."""
    for cell in [first, *(name for name in cells.names() if name != first)]:
        with cells.in_cell(cell):
            try:
                if _holds(kind, row_id):
                    return cell
            except DatabaseError as error:
                if not _unreachable(error):
                    raise
    return first


def _unreachable(error: BaseException) -> bool:
    """The database did not answer (as the API's 503 UNAVAILABLE reads it)."""
    return isinstance(translate(error), Unavailable)


class ConsoleCell:
    """Enters the console request's cell: `?cell=NAME` picks it (kept in the
    session, then the page again without the parameter, which the admin's
    lists would refuse as a filter); a task or attempt page by id goes to
    the cell that holds the row."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not cells.configured() or not request.path.startswith("/admin/"):
            return self.get_response(request)
        names = cells.names()
        picked = request.GET.get(PICK)
        if picked is not None:
            if picked in names:
                request.session[SESSION_KEY] = picked
            rest = request.GET.copy()
            del rest[PICK]
            query = rest.urlencode()
            return HttpResponseRedirect(request.path + (f"?{query}" if query else ""))
        cell = request.session.get(SESSION_KEY)
        if cell not in names:
            cell = names[0]
        row = _ROW_PAGE.match(request.path)
        if row is not None and request.user.is_authenticated:
            found = _cell_holding(row[1], row[2], cell)
            if found != cell:
                request.session[SESSION_KEY] = cell = found
        with cells.in_cell(cell):
            return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        return unavailable_page(request, exception)


def unavailable_page(request: HttpRequest, error: BaseException) -> HttpResponse | None:
    """A console page whose database does not answer says so, 503 (with cells: which
    cell, and the picker to another), not an internal error: the blast radius of a cell
    is its own. None for any other error."""
    if not request.path.startswith("/admin/") or not _unreachable(error):
        return None
    cell = cells.entered()
    response = render(request, "admin/orbit_database_unavailable.html", {"cell": cell}, status=503)
    response["Retry-After"] = "1"
    return response


def picker(request: HttpRequest) -> dict[str, Any]:
    """Template context: each cell with the link that shows this page in it
    (its own query kept), and the cell this page shows; empty without cells."""
    if not cells.configured() or not request.path.startswith("/admin/"):
        return {}
    links = []
    for cell in cells.names():
        query = request.GET.copy()
        query[PICK] = cell
        links.append((cell, f"{request.path}?{query.urlencode()}"))
    return {"orbit_cells": links, "orbit_cell": cells.entered()}

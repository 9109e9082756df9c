"""The console across cells: each console request runs in one cell, the
operator's choice (a picker on every page, kept in the session), and a task's
page found by its id in whichever cell holds it. Without ORBIT_CELLS nothing
here does anything."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponse, HttpResponseRedirect

from orbit import cells

SESSION_KEY = "orbit_cell"
PICK = "cell"
# A page of one row by its id, found in any cell: the task, the attempt.
_ROW_PAGE = re.compile(r"^/admin/tasks/(task|attempt)/([0-9a-f]{32})/change/$")


def _holds(kind: str, row_id: str) -> bool:
    from tasks.models import Attempt, Task

    return (Task if kind == "task" else Attempt).objects.filter(id=row_id).exists()


def _cell_holding(kind: str, row_id: str, first: str) -> str:
    """The cell that holds the row, `first` looked in first (and kept when none does)."""
    for cell in [first, *(name for name in cells.names() if name != first)]:
        with cells.in_cell(cell):
            if _holds(kind, row_id):
                return cell
    return first


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

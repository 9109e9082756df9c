"""`orbit_cells`: the installation's cells, their applications, whether each
answers, and how many tasks each holds."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connection
from django.db.models import Count

from orbit import cells
from orbit.models import Application, CellPlacement
from tasks.models import FINAL_TASK_STATES, Task


def _where(alias_settings: dict[str, Any]) -> str:
    if alias_settings["ENGINE"] == "django.db.backends.sqlite3":
        return f"sqlite {alias_settings['NAME']}"
    return f"{alias_settings['HOST']}:{alias_settings['PORT']}/{alias_settings['NAME']}"


class Command(BaseCommand):
    help = "List the cells (ORBIT_CELLS), their applications, whether each answers, and its task counts."

    def handle(self, *args: Any, **options: Any) -> None:
        """The report on stdout; exit status 1 (one line on stderr) when a cell does
        not answer or a placement names a cell ORBIT_CELLS lacks, so that a script
        or a monitor can tell a healthy installation by the status alone."""
        if not cells.configured():
            self.stdout.write(
                f"one cell, the default database ({_where(settings.DATABASES['default'])}); ORBIT_CELLS is not set"
            )
            if not self.describe(None):
                raise CommandError("the database does not answer")
            return
        placed: dict[str, list[tuple[str, str]]] = {}
        for application_id, name, cell in CellPlacement.objects.order_by("name").values_list(
            "application_id", "name", "cell"
        ):
            placed.setdefault(cell, []).append((name, application_id))
        self.stdout.write(f"directory {_where(settings.DATABASES['default'])}; {len(cells.names())} cells")
        silent = []
        for cell in cells.names():
            listed = placed.pop(cell, [])
            where = _where(settings.DATABASES[cells.alias_of(cell)])
            self.stdout.write(f"cell {cell} ({where}): {len(listed)} application{'' if len(listed) == 1 else 's'}")
            with cells.in_cell(cell):
                if not self.describe(listed):
                    silent.append(cell)
        for cell, listed in placed.items():  # placements naming a cell ORBIT_CELLS no longer has
            names = ", ".join(name for name, _ in listed)
            self.stdout.write(
                self.style.ERROR(f"cell {cell}: not in ORBIT_CELLS, yet the directory places {names} there")
            )
        problems = [f"cell {cell} does not answer" for cell in silent]
        problems += [f"cell {cell} is not in ORBIT_CELLS" for cell in placed]
        if problems:
            raise CommandError("; ".join(problems))

    def describe(self, listed: list[tuple[str, str]] | None) -> bool:
        """The entered cell's state and counts; `listed`: its applications by the
        directory. Whether the cell answered."""
        try:
            applications = dict(Application.objects.values_list("id", "name"))
            by_state = dict(Task.objects.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
        except DatabaseError as exc:
            connection.close()
            self.stdout.write(f"  unreachable: {type(exc).__name__}: {exc}")
            return False
        total = sum(by_state.values())
        unfinished = sum(n for state, n in by_state.items() if state not in FINAL_TASK_STATES)
        self.stdout.write(f"  reachable; {total} tasks, {unfinished} unfinished")
        for name, application_id in listed if listed is not None else sorted((n, i) for i, n in applications.items()):
            missing = "" if application_id in applications else " (placed here, rows not created yet)"
            self.stdout.write(f"  {name}\t{application_id}{missing}")
        return True

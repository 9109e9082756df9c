from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from orbit import cells
from tasks.invariants import find_violations_in_snapshot, placement_violations


class Command(BaseCommand):
    help = (
        "Recompute every counter and permit from the rows (of every cell, each checked against the directory); "
        "exit 1 on any drift."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        problems = []
        for cell in cells.each():  # with cells, each cell's own rows (nothing spans two), and its placements
            with cells.in_cell(cell):
                if cell is None:
                    problems += find_violations_in_snapshot()
                else:
                    found = find_violations_in_snapshot() + placement_violations(cell)
                    problems += [f"cell {cell}: {problem}" for problem in found]
        for problem in problems:
            self.stderr.write(problem)
        if problems:
            raise CommandError(f"{len(problems)} invariant violations")
        where = f" in cells {', '.join(cells.names())}" if cells.configured() else ""
        self.stdout.write(f"orbit_check: ok (counters, permits, keys and tokens agree with the rows){where}")

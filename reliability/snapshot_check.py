"""tasks.invariants.find_violations inside one consistent snapshot.

The same checks as `manage.py orbit_check` (tasks.invariants.find_violations_in_snapshot:
one REPEATABLE READ transaction, exact while work continues). The harness runs
this after every chaos event, with load still running, and `manage.py orbit_check`
at the end. With ORBIT_CELLS, as orbit_check, it checks each cell's rows in a snapshot
of that cell (nothing spans two cells).

    ORBIT_MYSQL_DSN=mysql://root:@127.0.0.1:PORT/orbit_chaos python reliability/snapshot_check.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")


def main() -> int:
    import django

    django.setup()
    from django.db import connection

    from orbit import cells
    from tasks.invariants import find_violations_in_snapshot

    if connection.vendor != "mysql":
        print("snapshot_check: needs ORBIT_MYSQL_DSN", file=sys.stderr)
        return 2
    problems = []
    for cell in cells.each():  # without cells: once, on the one database
        with cells.in_cell(cell):
            problems += [
                problem if cell is None else f"cell {cell}: {problem}" for problem in find_violations_in_snapshot()
            ]
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"snapshot_check: {len(problems)} invariant violations", file=sys.stderr)
        return 1
    print("snapshot_check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

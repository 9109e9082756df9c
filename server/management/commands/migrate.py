"""`migrate`, and with ORBIT_CELLS the directory and then every cell.

Django's migrate, unchanged for one database; with cells, a run from the
command line without --database (or with the default one) migrates the
directory and then each cell in ORBIT_CELLS's order, so `orbit migrate`
upgrades the installation in one command. A call from code migrates the one
database it names (Django's test set-up makes one call per alias, each cell's
test database created just before its own). Each database holds only its own
tables (orbit.cells.CellRouter)."""

from __future__ import annotations

from typing import Any

from django.core.management.commands.migrate import Command as DjangoMigrate
from django.db import DEFAULT_DB_ALIAS

from orbit import cells


class Command(DjangoMigrate):
    help = DjangoMigrate.help + " With ORBIT_CELLS: the directory, then every cell."

    def handle(self, *args: Any, **options: Any) -> None:
        if not cells.configured():
            super().handle(*args, **options)
            return
        every_cell = getattr(self, "_called_from_command_line", False) and options["database"] == DEFAULT_DB_ALIAS
        for cell in [None, *cells.names()] if every_cell else [cells.named_by_alias(options["database"])]:
            if every_cell and options["verbosity"] >= 1:
                self.stdout.write(self.style.MIGRATE_HEADING("The directory:" if cell is None else f"Cell {cell}:"))
            # Entered, so a data migration's ORM queries (no `using`) reach this cell too.
            with cells.in_cell(cell):
                super().handle(
                    *args, **{**options, "database": DEFAULT_DB_ALIAS if cell is None else cells.alias_of(cell)}
                )

"""`orbit_application create NAME [--cell CELL]` and `orbit_application list`:
applications by themselves, without a namespace, queue or credential (which
`orbit_bootstrap` adds); with cells, where each one is placed."""

from __future__ import annotations

from typing import Any, cast

from django.core.management.base import BaseCommand, CommandParser

from orbit import cells
from orbit.models import Application, CellPlacement
from orbit.tenancy import ensure_application
from server.management.commands._credentials_file import check_name, enter_placed_application, one_line_errors


class Command(BaseCommand):
    help = "Create an application (placed in --cell, or the cell with the fewest), or list them with their cells."

    def add_arguments(self, parser: CommandParser) -> None:
        verbs = parser.add_subparsers(dest="verb", required=True)
        create = verbs.add_parser("create", help="create an application, or report the existing one of that name")
        create.add_argument("name")
        create.add_argument(
            "--cell", help="with ORBIT_CELLS: the cell of a new application (default: the one with the fewest)"
        )
        verbs.add_parser("list", help="every application, its id and its cell")

    def handle(self, *args: Any, **options: Any) -> None:
        with one_line_errors():
            getattr(self, f"handle_{options['verb']}")(options)

    def handle_create(self, options: dict[str, Any]) -> None:
        name = options["name"]
        check_name("name", name, cast(int, Application._meta.get_field("name").max_length))
        existed = (
            CellPlacement.objects.filter(name=name).exists()
            if cells.configured()
            else Application.objects.filter(name=name).exists()
        )
        enter_placed_application(name, options["cell"])
        application = ensure_application(name)
        placed_in = cells.entered()
        where = f", cell {placed_in}" if placed_in is not None else ""
        verb = "exists" if existed else "created"
        self.stdout.write(f"application {name} {verb} (id {application.id}{where})")

    def handle_list(self, options: dict[str, Any]) -> None:
        if cells.configured():
            for application_id, name, cell in CellPlacement.objects.order_by("name").values_list(
                "application_id", "name", "cell"
            ):
                self.stdout.write(f"{application_id}\t{name}\t{cell}")
            return
        for application_id, name in Application.objects.order_by("name").values_list("id", "name"):
            self.stdout.write(f"{application_id}\t{name}")

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from server.moves import MoveRefused, move_application


class Command(BaseCommand):
    help = (
        "Move an application (its id or name) to another cell: stop its intake, wait for its running "
        "attempts, copy every row, switch the directory, remove the old rows. Safe to run again after a crash."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("application", help="the application's id or name")
        parser.add_argument("--to", required=True, metavar="CELL", help="the cell to move it to")
        parser.add_argument(
            "--timeout",
            type=float,
            default=60.0,
            help=(
                "seconds to wait for its running attempts to end before calling the move off (60), "
                "counted once the requests admitted before intake stopped have ended"
            ),
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not 0 < options["timeout"] <= 86400:
            raise CommandError("--timeout: seconds, above 0 and at most 86400")
        try:
            move_application(options["application"], options["to"], timeout=options["timeout"], say=self.stdout.write)
        except MoveRefused as refused:
            raise CommandError(str(refused)) from None

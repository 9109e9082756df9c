"""`orbit serve` in `orbit help`'s list of commands. The command itself is not
this one: server/cli.py main() runs it before Django starts (uvloop's event
loop policy must be set before Django's setup imports daphne), and answers
`orbit help serve` with serve's own options."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Serve the HTTP API and the worker protocol (`orbit serve --help` lists the options)."

    def handle(self, *args: Any, **options: Any) -> None:
        # Reached only from Python (call_command): the command line never gets here.
        raise CommandError("run it as `orbit serve` (or `manage.py serve`): it starts before Django does")

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from tasks.invariants import find_violations_in_snapshot


class Command(BaseCommand):
    help = "Recompute every counter and permit from the rows; exit 1 on any drift."

    def handle(self, *args: Any, **options: Any) -> None:
        problems = find_violations_in_snapshot()
        for problem in problems:
            self.stderr.write(problem)
        if problems:
            raise CommandError(f"{len(problems)} invariant violations")
        self.stdout.write("orbit_check: ok (counters, permits, keys and tokens agree with the rows)")

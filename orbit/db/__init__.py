"""The engine under Orbit's verbs: how they reach the database.

- rows: the plain-SQL row layer (reads, locks and writes by primary key, sent together)
- pool: the database threads of a server process, each with its persistent connection
- groupcommit: lanes that decide the concurrent requests of one application in one transaction
- mysql: the MySQL backend (no foreign keys, multi-statement round trips, serving timeouts)

Views, consumers and commands never call these for a state change: the verbs
under each app's `actions` do (docs/architecture/)."""

from __future__ import annotations

from django.conf import settings


def inline() -> bool:
    """Tests that share the test case's transaction: database work runs on the
    caller's thread and connection (no pool thread, no lane thread), through
    the same verbs and rounds as in production."""
    return bool(settings.ORBIT_INLINE_DB)

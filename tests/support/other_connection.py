"""A second connection to the test database, outside Django's: what another
client sees, committed rows only."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import MySQLdb
from django.db import connection


@contextmanager
def other_cursor() -> Iterator[Any]:
    settings = connection.settings_dict
    other = MySQLdb.connect(
        host=settings["HOST"] or "127.0.0.1",
        port=int(settings["PORT"] or 3306),
        user=settings["USER"],
        passwd=settings["PASSWORD"],
        db=settings["NAME"],
    )
    try:
        yield other.cursor()
    finally:
        other.close()

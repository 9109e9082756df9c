"""The GCRA bound as a witness checks it: replays a key's approved Starts."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from tasks.key_rules import Rate

TOLERANCE = timedelta(milliseconds=1)


def gcra_violations(started: Iterable[datetime], rate: Rate) -> list[datetime]:
    """The Starts (sorted `started` times) that came before the bound let them:
    for every interval of length t, at most burst + t / T Starts."""
    late: list[datetime] = []
    tat: datetime | None = None
    for at in sorted(started):
        if tat is not None and tat - rate.tolerance > at + TOLERANCE:
            late.append(at)
        tat = max(tat, at) + rate.interval if tat is not None else at + rate.interval
    return late

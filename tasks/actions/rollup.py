"""The console's per-minute rollup (tasks.models.QueueMinute): approved Starts
and recorded results per queue and UTC minute, added in the transactions that
approve and record them. The parts count as they decide; the round writes the
counts once, at its end, as the last rows it locks before its events
(orbit.locking.LOCK_ORDER): one upsert, sent with the round's COMMIT."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from orbit.db.rows import db_value, write_statement
from tasks import sql
from tasks.models import QueueMinute

_gathering = threading.local()


def minute_of(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


@contextmanager
def gathered() -> Iterator[None]:
    """Counts made inside are written once, when the block ends."""
    if getattr(_gathering, "counts", None) is not None:
        yield  # an outer block writes them
        return
    _gathering.counts = {"starts": Counter(), "results": Counter()}
    try:
        yield
        _write(_gathering.counts)
    finally:
        _gathering.counts = None


def count(kind: str, queue_id: str, moment: datetime, n: int = 1) -> None:
    """`n` Starts (kind "starts") or results ("results") of a queue at `moment`."""
    counts = getattr(_gathering, "counts", None)
    if counts is None:
        _write({"starts": Counter(), "results": Counter(), kind: Counter({(queue_id, minute_of(moment)): n})})
        return
    counts[kind][(queue_id, minute_of(moment))] += n


def _write(counts: dict[str, Counter[tuple[str, datetime]]]) -> None:
    rows = sorted(set(counts["starts"]) | set(counts["results"]))
    if not rows:
        return
    params: list[object] = []
    for queue_id, minute in rows:
        params += [queue_id, db_value(QueueMinute, "minute", minute), counts["starts"][queue_id, minute]]
        params.append(counts["results"][queue_id, minute])
    write_statement(sql.rollup_add(len(rows)), params)

"""The locking statements a piece of code sends, checked against
orbit.locking.LOCK_ORDER (docs/architecture/locking.md).

Each captured query (django.test.utils.CaptureQueriesContext) may hold
several statements: the row layer sends a round's writes and locks together
(orbit.db.rows.select_together, writes_sent_together) and the MySQL backend
puts an autocommit change in front of the next statement (orbit.db.mysql).
The captured text has its parameters bound (the driver's last executed query),
so a statement is split only at a `;` outside quotes, and its tables are read
with its literals blanked out.

The rule, per transaction: a table's rows are never first locked after a row
of a later table was locked, and no table outside LOCK_ORDER is locked; a
guarded table (orbit.locking.GUARDED_BY) is locked only after its guard.
Locking statements: SELECT … FOR UPDATE [SKIP LOCKED], UPDATE, DELETE and
INSERT … ON DUPLICATE KEY UPDATE. Three kinds of lock wait for nothing, so
they cannot be the waiting side of a deadlock, and are not held to the order:
- a SKIP LOCKED read (locking.md, "SKIP LOCKED where the order would be
  broken": a lease takes its candidate tasks before their key rows);
- an UPDATE of rows the transaction itself inserted (by id), e.g. a submit
  marking its new task ready;
- the UPDATE of the idempotency record the transaction inserted first
  (orbit.idempotency: the record before the effect, its response after).
A plain INSERT is not a locking statement here ("writes before locks": a twin
waits on the unique index while holding nothing)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from orbit.locking import GUARDED_BY, LOCK_ORDER

# Tables whose only UPDATE in a transaction is of the row it inserted before any lock.
OWN_RECORD_TABLES = {"orbit_idempotency_record": "orbit.idempotency: the record inserted first, its response last"}


def _scan(sql: str) -> list[tuple[str, str]]:
    """(masked, raw) for each statement of one multi-statement query: masked
    has every quoted value replaced by '?' (identifiers kept), raw is as sent."""
    statements: list[tuple[str, str]] = []
    masked: list[str] = []
    start = 0
    quote: str | None = None
    index = 0
    while index < len(sql):
        char = sql[index]
        if quote is not None:
            if char == "\\" and quote != "`":
                index += 2
                continue
            if char == quote:
                if index + 1 < len(sql) and sql[index + 1] == quote:  # a doubled quote: still inside
                    index += 2
                    continue
                quote = None
                masked.append("?'" if char == "'" else char)
            elif quote == "`":
                masked.append(char)  # identifiers are kept: they name the tables
            index += 1
            continue
        if char in "'\"`":
            quote = char
            masked.append(char)
        elif char == ";":
            statements.append(("".join(masked).strip(), sql[start:index].strip()))
            masked, start = [], index + 1
        else:
            masked.append(char)
        index += 1
    statements.append(("".join(masked).strip(), sql[start:].strip()))
    return [(text, raw) for text, raw in statements if text]


def split_statements(sql: str) -> list[str]:
    """The statements of one multi-statement query, literals replaced by '?':
    a `;` inside a quoted value does not end a statement. Backslash escapes
    (what the driver writes) and doubled quotes are both understood."""
    return [text for text, _ in _scan(sql)]


def _values(text: str) -> list[str]:
    """The comma-separated values of `text` (quotes respected), unquoted."""
    values, current, quote, index = [], [], None, 0
    while index < len(text):
        char = text[index]
        if quote is None and char == ",":
            values.append("".join(current).strip())
            current = []
        else:
            if quote is None and char in "'\"":
                quote = char
            elif quote is not None and char == "\\":
                current.append(text[index : index + 2])
                index += 2
                continue
            elif char == quote:
                quote = None
            current.append(char)
        index += 1
    values.append("".join(current).strip())
    return [value.strip("'\"") for value in values if value]


def _first_values(tuples: str) -> list[str]:
    """The first value of each (…) of an INSERT's VALUES list."""
    firsts, depth, quote, current, index = [], 0, None, None, 0
    while index < len(tuples):
        char = tuples[index]
        if quote is not None:
            if char == "\\":
                if current is not None:
                    current.append(tuples[index : index + 2])
                index += 2
                continue
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "(":
            depth += 1
            if depth == 1:
                current = []
                index += 1
                continue
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 1 and current is not None:
            firsts.append("".join(current).strip().strip("'\""))
            current = None
        if current is not None:
            current.append(char)
        index += 1
    return firsts


_NAME = r"((?:`[^`]+`|\w+)(?:\.(?:`[^`]+`|\w+))?)"
_UPDATE = re.compile(rf"^UPDATE\s+(?:LOW_PRIORITY\s+)?(?:IGNORE\s+)?{_NAME}", re.I)
_DELETE = re.compile(rf"^DELETE\s+FROM\s+{_NAME}", re.I)
_INSERT = re.compile(rf"^INSERT\s+(?:IGNORE\s+)?INTO\s+{_NAME}", re.I)
_FROM_OR_JOIN = re.compile(rf"\b(?:FROM|JOIN)\s+{_NAME}", re.I)
_SELECT_LOCK = re.compile(r"\bFOR\s+UPDATE(\s+SKIP\s+LOCKED|\s+NOWAIT)?\s*$|\bLOCK\s+IN\s+SHARE\s+MODE\s*$", re.I)
_PARENTHESIZED = re.compile(r"\([^()]*\)")
_UPSERT = re.compile(r"\bON\s+DUPLICATE\s+KEY\s+UPDATE\b", re.I)
_BY_ID = re.compile(
    r"\bWHERE\s+(?:`?\w+`?\.)?`?id`?\s+(?:IN\s*\((?P<many>.*)\)|=\s*(?P<one>'[^']*'|\d+))\s*$", re.I | re.S
)
_INSERT_IDS = re.compile(
    r"^INSERT\s+(?:IGNORE\s+)?INTO\s+\S+\s*\(\s*`?id`?\s*,.*?\)\s*VALUES\s*(?P<tuples>.*)$", re.I | re.S
)


def _table(name: str) -> str:
    return name.split(".")[-1].strip("`")


@dataclass(frozen=True)
class Lock:
    """One statement that takes row locks: its table, what it is, and the ids
    of the rows it names when it names them by id (UPDATE … WHERE id …)."""

    table: str
    kind: str  # "FOR UPDATE", "FOR UPDATE SKIP LOCKED", "LOCK IN SHARE MODE", "UPDATE", "DELETE", "UPSERT"
    statement: str
    rows: frozenset[str] | None = None

    def __str__(self) -> str:
        return f"{self.kind:<22} {self.table}"


@dataclass(frozen=True)
class Insert:
    """A plain INSERT (no lock that can wait): the rows it made, by id when it gives them."""

    table: str
    rows: frozenset[str] | None = None

    def __str__(self) -> str:
        return f"{'(insert)':<22} {self.table}"


@dataclass(frozen=True)
class Boundary:
    """Where a transaction begins or ends."""

    what: str  # "BEGIN" (autocommit off) or "END" (COMMIT, ROLLBACK, autocommit on)


Entry = Lock | Insert | Boundary


def classify(statement: str, raw: str | None = None) -> list[Entry]:
    """The locks, inserts and transaction boundaries of one statement (`statement`
    with its literals blanked, `raw` as sent; raw gives the ids of rows)."""
    text = " ".join(statement.split())
    raw = text if raw is None else raw.strip()
    upper = text.upper()
    if upper in ("COMMIT", "ROLLBACK") or upper.replace(" ", "").startswith("SETAUTOCOMMIT=1"):
        return [Boundary("END")]
    if upper.replace(" ", "").startswith("SETAUTOCOMMIT=0") or upper in ("BEGIN", "START TRANSACTION"):
        return [Boundary("BEGIN")]
    if upper.startswith("SELECT"):
        found = _SELECT_LOCK.search(text)
        if found is None:
            return []
        kind = " ".join(found.group(0).upper().split())
        # The outer query's tables only: a locking read does not lock the rows
        # a subquery reads (MySQL reference manual, "Locking Reads").
        outer = text
        while _PARENTHESIZED.search(outer):
            outer = _PARENTHESIZED.sub(" ", outer)
        return [Lock(_table(name), kind, text) for name in _FROM_OR_JOIN.findall(outer)]
    matched = _UPDATE.match(text)
    if matched:
        by_id = _BY_ID.search(raw)
        rows = None
        if by_id:
            rows = frozenset(_values(by_id.group("many")) if by_id.group("many") is not None else [by_id.group("one")])
            rows = frozenset(row.strip("'") for row in rows)
        return [Lock(_table(matched.group(1)), "UPDATE", text, rows)]
    matched = _DELETE.match(text)
    if matched:
        return [Lock(_table(matched.group(1)), "DELETE", text)]
    matched = _INSERT.match(text)
    if matched:
        if _UPSERT.search(text):
            return [Lock(_table(matched.group(1)), "UPSERT", text)]
        ids = _INSERT_IDS.match(raw)
        return [Insert(_table(matched.group(1)), frozenset(_first_values(ids.group("tuples"))) if ids else None)]
    return []


def locking_sequence(captured: Iterable[dict[str, Any]]) -> list[Entry]:
    """Every lock, insert and transaction boundary of the captured queries, in the order sent."""
    sequence: list[Entry] = []
    for query in captured:
        for text, raw in _scan(query["sql"]):
            sequence.extend(classify(text, raw))
    return sequence


def transactions(sequence: Iterable[Entry]) -> Iterator[list[Lock | Insert]]:
    """The locks and inserts of each transaction (a statement sent in autocommit is one of its own)."""
    current: list[Lock | Insert] = []
    inside = False
    for entry in sequence:
        if isinstance(entry, Boundary):
            if current:
                yield current
            current, inside = [], entry.what == "BEGIN"
        elif inside:
            current.append(entry)
        else:
            yield [entry]
    if current:
        yield current


def waits_for_nothing(lock: Lock, inserted: dict[str, set[str]], inserted_tables: set[str]) -> bool:
    """Whether `lock` cannot wait for another transaction (see the module's docstring)."""
    if lock.kind.endswith("SKIP LOCKED"):
        return True
    if lock.kind == "UPDATE" and lock.rows and lock.rows <= inserted.get(lock.table, set()):
        return True
    return lock.kind == "UPDATE" and lock.table in OWN_RECORD_TABLES and lock.table in inserted_tables


def violations(entries: list[Lock | Insert]) -> list[str]:
    """What breaks LOCK_ORDER in one transaction: a table outside it, or a
    table first locked after a row of a later table."""
    found: list[str] = []
    held: set[str] = set()
    latest: str | None = None
    inserted: dict[str, set[str]] = {}
    inserted_tables: set[str] = set()
    for entry in entries:
        if isinstance(entry, Insert):
            inserted_tables.add(entry.table)
            inserted.setdefault(entry.table, set()).update(entry.rows or ())
            continue
        if waits_for_nothing(entry, inserted, inserted_tables):
            if entry.kind.endswith("SKIP LOCKED") and entry.table in LOCK_ORDER:
                held.add(entry.table)  # its rows are held now: locking them again later is a re-lock
            continue
        if entry.table not in LOCK_ORDER:
            found.append(f"{entry.table} is not in LOCK_ORDER ({entry.kind})")
            continue
        guard = GUARDED_BY.get(entry.table)
        if guard is not None:
            if guard not in held:
                found.append(f"{entry.table} locked without its guard {guard}")
            held.add(entry.table)
            continue
        place = LOCK_ORDER.index(entry.table)
        if entry.table not in held and latest is not None and place < LOCK_ORDER.index(latest):
            found.append(f"{entry.table} first locked after {latest}")
        held.add(entry.table)
        if latest is None or place > LOCK_ORDER.index(latest):
            latest = entry.table
    return found


def describe(sequence: list[Entry]) -> str:
    lines = [f"  -- {entry.what}" if isinstance(entry, Boundary) else f"  {entry}" for entry in sequence]
    return "\n".join(lines) or "  (no locking statement)"


def assert_lock_order(captured: Any, *, expect: Iterable[str] = ()) -> list[list[str]]:
    """Fails, listing the whole sequence, if a transaction of the captured
    queries breaks LOCK_ORDER; each table of `expect` must be locked
    somewhere (so a test cannot pass by locking nothing). Returns the tables
    each transaction locked, in order, duplicates dropped."""
    queries = captured.captured_queries if hasattr(captured, "captured_queries") else captured
    sequence = locking_sequence(queries)
    problems = [problem for entries in transactions(sequence) for problem in violations(entries)]
    assert not problems, "lock order broken: " + "; ".join(problems) + "\n" + describe(sequence)
    tables = [
        list(dict.fromkeys(entry.table for entry in entries if isinstance(entry, Lock)))
        for entries in transactions(sequence)
    ]
    missing = set(expect) - {table for locked in tables for table in locked}
    assert not missing, f"expected locks on {sorted(missing)}\n" + describe(sequence)
    return [locked for locked in tables if locked]

"""The engine's hand-written SQL, each statement named and explained in one
place (the model is Procrastinate's sql/queries.sql). Everything else the
engine sends goes through the ORM or orbit.db.rows.

A constant is a fragment or statement with `%s` parameters; a function
fills in what only the connection knows (quoted identifiers, the vendor's
upsert and index hint) or what the call decides (how many handlers or ids),
and returns the text orbit.db.rows runs. The text is the same for the same
shape of call, so the database's statement cache keeps working."""

from __future__ import annotations

import functools

from django.db import connection

# The lease order (SPEC §7), as idx_task_dispatch and idx_task_ns_ckey hold
# it: higher priority first, then the longest available, then the id for a
# stable order.
LEASE_ORDER = "ORDER BY priority DESC, available_at ASC, id ASC"

# --- the lease's candidates (the dispatch index, SPEC §10) -----------------

# The WAITING ready tasks of one queue available now whose total deadline has
# not passed. Parameters: available_at bound, key_ready True, queue_id,
# state WAITING, deadline bound. It is the prefix of idx_task_dispatch.
CANDIDATES = (
    "available_at <= %s AND key_ready = %s AND queue_id = %s AND state = %s"
    " AND (deadline_at IS NULL OR deadline_at > %s)"
)

# For a worker that took no concurrency keys: unkeyed tasks only.
CANDIDATE_UNKEYED = "concurrency_key = ''"

# For a worker that takes keys: keys with no permit to give now are excluded
# before the LIMIT, so a backlog behind one busy or rate-limited key never
# hides the work of other keys or unkeyed work (no head-of-line blocking):
# every permit held (`holders` against the capacity its policy gave the row,
# kept on the row: tasks.key_rules.cache_rule), no start room before
# `next_start_at`, or the token space spent, which can never lease again (its
# bound is a literal: SQLite's integers cannot hold it as a parameter). The
# lease decides again under the row's lock with the policy in force.
# Parameter: the time now.
CANDIDATE_KEY_FREE = (
    "(concurrency_key = '' OR NOT EXISTS (SELECT 1 FROM {key_table} k"
    " WHERE k.{key} = {task_table}.concurrency_key AND k.namespace_id = {task_table}.namespace_id"
    " AND (k.holders >= k.capacity OR k.version > {max_version} OR k.next_start_at > %s)))"
)

# One (handler, version) pair a worker serves; a worker that listed its
# handlers leases only tasks of one of them. An empty version (a hello entry
# without one) admits every version of the handler. Parameters: handler,
# version, version.
CANDIDATE_HANDLER = "(handler = %s AND (handler_version = %s OR %s = ''))"


def candidate_filter(*, keyed: bool, handlers: int, max_key_version: int) -> str:
    """The WHERE of the lease's scan of one queue: CANDIDATES, then the keys
    the worker may take (CANDIDATE_KEY_FREE, whose parameter follows
    CANDIDATES'), then `handlers` CANDIDATE_HANDLER pairs (none: any handler)."""
    return _candidate_filter(connection.vendor, keyed, handlers, max_key_version)


@functools.cache
def _candidate_filter(vendor: str, keyed: bool, handlers: int, max_key_version: int) -> str:
    """candidate_filter's text, built once per shape and vendor (its quoting):
    every lease asks for it."""
    quote = connection.ops.quote_name
    where = [CANDIDATES]
    if keyed:
        where.append(
            CANDIDATE_KEY_FREE.format(
                key_table=quote("orbit_concurrency_key"),
                task_table=quote("orbit_task"),
                key=quote("key"),
                max_version=int(max_key_version),
            )
        )
    else:
        where.append(CANDIDATE_UNKEYED)
    if handlers:
        where.append(f"({' OR '.join([CANDIDATE_HANDLER] * handlers)})")
    return " AND ".join(where)


def candidates(*, keyed: bool, handlers: int, max_key_version: int) -> str:
    """candidate_filter in the lease order, with LIMIT %s."""
    return f"{candidate_filter(keyed=keyed, handlers=handlers, max_key_version=max_key_version)} {LEASE_ORDER} LIMIT %s"


# --- the ready set of keyed work (tasks.actions.readiness) -----------------

# The WAITING tasks of one (namespace, key, queue). Parameters: namespace_id,
# concurrency_key, queue_id, state WAITING.
KEY_GROUP = "namespace_id = %s AND concurrency_key = %s AND queue_id = %s AND state = %s"

# Any task of the group with this key_ready (the ready one, or whether there
# is another). Parameters: KEY_GROUP's, key_ready.
GROUP_ANY = f"{KEY_GROUP} AND key_ready = %s LIMIT 1"

# The group's best not-ready task available now, in the lease order: the one
# to make ready. Parameters: KEY_GROUP's, key_ready False, available_at bound.
GROUP_BEST_AVAILABLE = f"{KEY_GROUP} AND key_ready = %s AND available_at <= %s {LEASE_ORDER} LIMIT 1"

# With none available: the group's not-ready task available first. It walks
# every waiting task of the group, so it is asked only when the others found
# siblings but none available. Parameters: KEY_GROUP's, key_ready False.
GROUP_FIRST_LATER = f"{KEY_GROUP} AND key_ready = %s ORDER BY available_at ASC, priority DESC, id ASC LIMIT 1"

# next_in_line: for each ready candidate `c` (by id), its group's best
# not-ready sibling available now and within its deadline, and the rows it
# names (the caller locks them). One correlated scalar subquery (an index
# range of its group, LIMIT 1) is planned once for all the groups; one scalar
# subquery per group was planned once each, most of the statement's time. It
# reads without a lock: under the application_state lock no other
# transaction changes the application's WAITING rows. MariaDB is told its
# index ({hint}): it would scan the dispatch index for it. Parameters: state
# WAITING, key_ready False, available_at bound, deadline bound, then the ids.
NEXT_IN_LINE = (
    "{id} IN (SELECT (SELECT {id} FROM {task_table} s{hint} WHERE namespace_id = c.namespace_id"
    " AND concurrency_key = c.concurrency_key AND queue_id = c.queue_id AND state = %s AND key_ready = %s"
    " AND available_at <= %s AND (deadline_at IS NULL OR deadline_at > %s) {order} LIMIT 1)"
    " FROM {task_table} c WHERE c.{id} IN ({ids}))"
)


# next_in_line in a fair queue: for each (namespace, key, queue) group, its
# fairness groups' available WAITING tasks by priority: the first
# available_at at each, and when that fairness group was last served
# (readiness._fair_lines ranks them). Each group's part (FAIR_HEADS) reads
# idx_task_ns_ckey alone (fairness_key is its last column): one pass over the
# key's available waiting entries in the queue, grouped by fairness key and
# priority alone (grouping by the group's columns too cost a temporary table
# keyed by them, twice the time; a window function ranking them, ten times).
# So tasks past their deadline count too (the sweep ends them within a
# second); FAIR_GROUP_BEST, which reads the rows, skips them. It reads
# without a lock, under the application_state lock (as NEXT_IN_LINE).
# Parameters, each group's: namespace_id, concurrency_key, queue_id twice,
# state WAITING, available_at bound.
FAIR_NEXT_IN_LINE = (
    "SELECT g.namespace_id, g.concurrency_key, g.queue_id, g.fairness_key, g.priority, g.first_available,"
    " f.served_at FROM ({heads}) g"
    " LEFT JOIN {share_table} f ON f.queue_id = g.queue_id AND f.fairness_key = g.fairness_key"
)
FAIR_HEADS = (
    "SELECT %s AS namespace_id, %s AS concurrency_key, %s AS queue_id, fairness_key, priority,"
    " MIN(available_at) AS first_available FROM {task_table}{hint}"
    " WHERE namespace_id = %s AND concurrency_key = %s AND queue_id = %s AND state = %s AND available_at <= %s"
    " GROUP BY fairness_key, priority"
)

# The best not-ready task of one fairness group within a key group, at the
# priority and first available_at FAIR_NEXT_IN_LINE found for it: a seek in
# idx_task_ns_ckey to that place. Parameters: KEY_GROUP's, key_ready False,
# fairness_key, priority, first available_at, available_at bound, deadline bound.
FAIR_GROUP_BEST = (
    f"{KEY_GROUP} AND key_ready = %s AND fairness_key = %s AND priority = %s AND available_at >= %s"
    " AND available_at <= %s AND (deadline_at IS NULL OR deadline_at > %s) ORDER BY available_at ASC, id ASC LIMIT 1"
)


def fair_next_in_line(count: int) -> str:
    """FAIR_NEXT_IN_LINE for `count` groups."""
    quote = connection.ops.quote_name
    hint = " FORCE INDEX (idx_task_ns_ckey)" if connection.vendor == "mysql" else ""
    heads = FAIR_HEADS.format(task_table=quote("orbit_task"), hint=hint)
    return FAIR_NEXT_IN_LINE.format(share_table=quote("orbit_fair_share"), heads=" UNION ALL ".join([heads] * count))


def next_in_line(count: int) -> str:
    """NEXT_IN_LINE for `count` ready candidates, as the WHERE of a select of tasks."""
    quote = connection.ops.quote_name
    return NEXT_IN_LINE.format(
        id=quote("id"),
        task_table=quote("orbit_task"),
        hint=" FORCE INDEX (idx_task_ns_ckey)" if connection.vendor == "mysql" else "",
        order=LEASE_ORDER,
        ids=", ".join(["%s"] * count),
    )


# --- the fair lease order (tasks.actions.fairness) ------------------------

# The candidates of one queue (the normal scan's WHERE, `{where}`) ranked in
# the fair order, without a lock: `rn` is a task's place in its group at its
# priority (1 = the group's best), `served_at` when its group was last served
# (NULL: never, first). Priority first, then one task of each group per turn,
# groups by how long ago they were served, then the oldest available. The
# partition includes priority so a group's high-priority backlog does not
# push its lower-priority tasks behind other groups' at that lower priority.
# `{excluded}`: ids an earlier pass saw but could not lock. Parameters: the
# WHERE's, the excluded ids, queue_id, LIMIT.
FAIR_RANKED = (
    "SELECT r.{id}, r.rn, f.served_at FROM ("
    "SELECT {id}, fairness_key, priority, available_at,"
    " ROW_NUMBER() OVER (PARTITION BY fairness_key, priority ORDER BY available_at ASC, {id} ASC) AS rn"
    " FROM {task_table} WHERE {where}{excluded}) r"
    " LEFT JOIN {share_table} f ON f.queue_id = %s AND f.fairness_key = r.fairness_key"
    " ORDER BY r.priority DESC, r.rn ASC, f.served_at IS NOT NULL, f.served_at ASC, r.available_at ASC, r.{id} ASC"
    " LIMIT %s"
)

# The ranked ids locked, the candidate WHERE applied again: a row another
# transaction changed since the ranking (taken, cancelled) no longer
# matches, one it holds is skipped. Parameters: the WHERE's, then the ids.
FAIR_LOCK = "{where} AND {id} IN ({ids})"

# --- when each fairness group was last served (tasks.actions.fairness) ----

# Sets served_at of (queue, key) rows, creating those never served: one
# statement at the end of a lease. Parameters: per row queue_id,
# fairness_key, served_at.
SERVED_UPSERT = "INSERT INTO {table} (queue_id, fairness_key, served_at) VALUES {rows} {upsert}"

SERVED_ON_CONFLICT = {
    "mysql": "ON DUPLICATE KEY UPDATE served_at = VALUES(served_at)",
    "sqlite": "ON CONFLICT (queue_id, fairness_key) DO UPDATE SET served_at = excluded.served_at",
}

# --- the console's per-minute rollup (tasks.actions.rollup) ----------------

# Adds a round's Starts and results to their (queue, minute) rows, creating
# the rows it lacks: one statement, sent with the round's COMMIT. Parameters:
# per row queue_id, minute, starts, results.
ROLLUP_ADD = "INSERT INTO {table} (queue_id, minute, starts, results) VALUES {rows} {upsert}"

# How each vendor adds to the row that already exists.
ROLLUP_UPSERT = {
    "mysql": "ON DUPLICATE KEY UPDATE starts = starts + VALUES(starts), results = results + VALUES(results)",
    "sqlite": "ON CONFLICT (queue_id, minute) DO UPDATE SET starts = starts + excluded.starts,"
    " results = results + excluded.results",
}


def rollup_add(rows: int) -> str:
    """ROLLUP_ADD for `rows` (queue, minute) rows on this connection's database."""
    return ROLLUP_ADD.format(
        table=connection.ops.quote_name("orbit_queue_minute"),
        rows=", ".join(["(%s, %s, %s, %s)"] * rows),
        upsert=ROLLUP_UPSERT[connection.vendor],
    )

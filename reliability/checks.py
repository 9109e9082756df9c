"""The chaos harness's end checks (reliability/harness.py): each function checks one
property of the quiet end state and returns the violations it found, one message each.

They read plain rows (dicts, as `Harness.check` loads them from the database) and the
workers' ledgers, never a connection, so a check can be read and tried on its own.
Timestamps are epoch seconds (floats), None where the row has none.
"""

from __future__ import annotations

import collections
import datetime
import heapq
import itertools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def utc_ts(value: datetime.datetime | None) -> float | None:
    """A DATETIME column as the checks' epoch seconds (MariaDB's are naive UTC)."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.UTC)
    return value.timestamp()


# -- tasks, attempts and idempotency records ------------------------------------


def accepted_tasks_not_lost(accepted: Mapping[str, str], tasks: Mapping[str, Row]) -> list[str]:
    """Every task a client got a receipt for is still in orbit_task (at most 20 named)."""
    lost = [key for key, task_id in accepted.items() if task_id not in tasks]
    return [f"accepted task lost: {key} -> {accepted[key]} is not in orbit_task" for key in lost[:20]]


def one_task_per_idempotency_key(tasks: Mapping[str, Row]) -> list[str]:
    by_idem: dict[str, list[str]] = collections.defaultdict(list)
    for task in tasks.values():
        by_idem[task["idem"]].append(task["id"])
    return [f"idempotency key {idem}: {len(ids)} tasks {ids}" for idem, ids in by_idem.items() if len(ids) > 1]


def record_task_id(raw: Any) -> str | None:
    data = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
    return (data.get("task") or {}).get("id")


def idempotency_records_point_at_their_tasks(records: Mapping[str, Any], tasks: Mapping[str, Row]) -> list[str]:
    """Each task.submit record names a task that exists and was submitted under that key."""
    found = []
    for key, raw in records.items():
        task_id = record_task_id(raw)
        if task_id is None or task_id not in tasks:
            found.append(f"idempotency record {key}: task {task_id} not in orbit_task")
        elif tasks[task_id]["idem"] != key:
            found.append(f"idempotency record {key}: points at task {task_id} of key {tasks[task_id]['idem']}")
    return found


def receipts_agree_with_idempotency_records(accepted: Mapping[str, str], records: Mapping[str, Any]) -> list[str]:
    """The task id a client was given for a key is the one the key's record keeps."""
    found = []
    for key, raw in records.items():
        task_id = record_task_id(raw)
        if key in accepted and accepted[key] != task_id:
            found.append(f"idempotency key {key}: client got {accepted[key]}, record says {task_id}")
    return found


def tasks_have_idempotency_records(tasks: Mapping[str, Row], records: Mapping[str, Any]) -> list[str]:
    orphans = [t["id"] for t in tasks.values() if t["idem"] not in records]
    return [f"task {task_id} has no idempotency record" for task_id in orphans[:20]]


def attempts_by_task(attempts: Iterable[Row]) -> dict[str, list[Row]]:
    """Each task's attempts in epoch order."""
    by_task: dict[str, list[Row]] = collections.defaultdict(list)
    for attempt in attempts:
        by_task[attempt["task_id"]].append(attempt)
    return {task_id: sorted(own, key=lambda a: a["epoch"]) for task_id, own in by_task.items()}


def attempt_counters_match_started_attempts(tasks: Mapping[str, Row], attempts: Iterable[Row]) -> list[str]:
    """task.attempts counts the started attempts, numbered 1..n, with no epoch given twice."""
    by_task = attempts_by_task(attempts)
    found = []
    for task_id, task in tasks.items():
        own = by_task.get(task_id, [])
        started = [a for a in own if a["started_at"] is not None]
        if task["attempts"] != len(started):
            found.append(f"task {task_id}: attempts={task['attempts']} but {len(started)} attempts started")
        numbers = sorted(a["number"] for a in started)
        if numbers != list(range(1, len(started) + 1)):
            found.append(f"task {task_id}: attempt numbers {numbers}")
        if len({a["epoch"] for a in own}) != len(own):
            found.append(f"task {task_id}: two attempts share an epoch")
    return found


def one_success_per_succeeded_task(tasks: Mapping[str, Row], attempts: Iterable[Row]) -> list[str]:
    """A SUCCEEDED task has exactly one succeeded attempt, any other none, and none comes after it."""
    by_task = attempts_by_task(attempts)
    found = []
    for task_id, task in tasks.items():
        own = by_task.get(task_id, [])
        successes = [a for a in own if a["state"] == "SUCCEEDED"]
        if task["state"] == "SUCCEEDED" and len(successes) != 1:
            found.append(f"task {task_id}: SUCCEEDED with {len(successes)} succeeded attempts")
        if task["state"] != "SUCCEEDED" and successes:
            found.append(f"task {task_id}: {task['state']} but has a succeeded attempt")
        if successes and own[-1]["id"] != successes[0]["id"]:
            found.append(f"task {task_id}: an attempt was leased after the succeeded one")
    return found


def attempts_by_key_in_lease_order(attempts: Iterable[Row]) -> dict[str, list[Row]]:
    by_key: dict[str, list[Row]] = collections.defaultdict(list)
    for attempt in attempts:
        if attempt["key"]:
            by_key[attempt["key"]].append(attempt)
    for own in by_key.values():
        own.sort(key=lambda a: (a["leased_at"], a["token"] or 0))
    return by_key


def key_tokens_increase_in_lease_order(attempts: Iterable[Row]) -> list[str]:
    found = []
    for key, own in attempts_by_key_in_lease_order(attempts).items():
        for previous, current in itertools.pairwise(own):
            if previous["token"] is None or current["token"] is None or current["token"] <= previous["token"]:
                found.append(
                    f"key {key}: token {current['token']} ({current['id']}) after {previous['token']} "
                    f"({previous['id']}) in lease order"
                )
    return found


@dataclass(frozen=True)
class KeyRule:
    """A key's capacity and start rate as the harness's policies give them (SPEC §12):
    `rate` is (starts, per_seconds, burst), None without a rate."""

    capacity: int = 1
    rate: tuple[int, int, int] | None = None

    @property
    def interval(self) -> float:
        """The GCRA emission interval T in seconds, rounded up to the microsecond as the engine does."""
        assert self.rate is not None
        starts, per_seconds, _ = self.rate
        return -(-per_seconds * 1_000_000 // starts) / 1_000_000


@dataclass(frozen=True)
class KeyRules:
    """The live key policies: an exact key beats the longest matching prefix, which beats
    the default (capacity 1, no rate)."""

    exact: Mapping[str, KeyRule] = field(default_factory=dict)
    prefixes: Mapping[str, KeyRule] = field(default_factory=dict)

    @classmethod
    def of(cls, policies: Iterable[Row]) -> KeyRules:
        """From orbit_key_policy rows (match_kind, match_value, capacity, rate_starts,
        rate_per_seconds, rate_burst)."""
        exact: dict[str, KeyRule] = {}
        prefixes: dict[str, KeyRule] = {}
        for policy in policies:
            rate = None
            if policy["rate_starts"] is not None and policy["rate_per_seconds"] is not None:
                rate = (policy["rate_starts"], policy["rate_per_seconds"], policy["rate_burst"] or 1)
            target = exact if policy["match_kind"] == "key" else prefixes
            target[policy["match_value"]] = KeyRule(policy["capacity"], rate)
        return cls(exact, prefixes)

    def of_key(self, key: str) -> KeyRule:
        if key in self.exact:
            return self.exact[key]
        matching = [prefix for prefix in self.prefixes if key.startswith(prefix)]
        return self.prefixes[max(matching, key=len)] if matching else KeyRule()


def _held_until(attempt: Row) -> float:
    """Until when the key counted the attempt's permit: its end, which for a lost lease is
    when a server recovered it (at or after lease_expires_at), so at least as long as the
    permit was valid; an attempt still open holds it for ever."""
    return attempt["finished_at"] if attempt["finished_at"] is not None else float("inf")


def key_holders_max(attempts: Iterable[Row]) -> dict[str, int]:
    """A figure per key: the most permits held at one moment (a permit held from leased_at
    to _held_until; one ending at the moment another is leased does not overlap it)."""
    found = {}
    for key, own in attempts_by_key_in_lease_order(attempts).items():
        moments = sorted([(a["leased_at"], 1) for a in own] + [(_held_until(a), -1) for a in own])
        held = most = 0
        for _, step in moments:  # at one moment the ends (-1) sort before the grants
            held += step
            most = max(most, held)
        found[key] = most
    return found


def key_holders_within_capacity(attempts: Iterable[Row], rules: KeyRules) -> list[str]:
    """At no moment more permits of a key are held than its capacity (capacity 1: an
    attempt of the key is leased only after the key's previous attempt finished)."""
    found = []
    for key, own in attempts_by_key_in_lease_order(attempts).items():
        capacity = rules.of_key(key).capacity
        held: list[tuple[float, str]] = []  # (held until, attempt id), a heap
        for current in own:
            while held and held[0][0] <= current["leased_at"]:
                heapq.heappop(held)
            if len(held) >= capacity:
                found.append(
                    f"key {key} (capacity {capacity}): attempt {current['id']} leased at "
                    f"{current['leased_at']:.6f} while {len(held)} permits were held "
                    f"({sorted(attempt_id for _, attempt_id in held)[:5]})"
                )
            heapq.heappush(held, (_held_until(current), current["id"]))
    return found


def key_slots_fit_capacity(attempts: Iterable[Row], rules: KeyRules) -> list[str]:
    """An attempt of a key with capacity N > 1 has a slot 0…N−1; under capacity 1 none."""
    found = []
    for key, own in attempts_by_key_in_lease_order(attempts).items():
        capacity = rules.of_key(key).capacity
        for attempt in own:
            slot = attempt["slot"]
            if (capacity == 1 and slot is not None) or (capacity > 1 and (slot is None or not 0 <= slot < capacity)):
                found.append(f"key {key} (capacity {capacity}): attempt {attempt['id']} has slot {slot}")
    return found


def attempts_by_slot_in_lease_order(attempts: Iterable[Row]) -> dict[tuple[str, int | None], list[Row]]:
    by_slot: dict[tuple[str, int | None], list[Row]] = collections.defaultdict(list)
    for key, own in attempts_by_key_in_lease_order(attempts).items():
        for attempt in own:
            by_slot[(key, attempt["slot"])].append(attempt)
    return by_slot


def slot_holders_never_overlap(attempts: Iterable[Row]) -> list[str]:
    """One (key, slot) is granted again only after its previous holder finished, each time
    with a higher token."""
    found = []
    for (key, slot), own in attempts_by_slot_in_lease_order(attempts).items():
        for previous, current in itertools.pairwise(own):
            if _held_until(previous) > current["leased_at"]:
                found.append(
                    f"key {key} slot {slot}: attempt {current['id']} leased at {current['leased_at']:.6f} while "
                    f"{previous['id']} held the slot (until {previous['finished_at']})"
                )
            if (current["token"] or 0) <= (previous["token"] or 0):
                found.append(f"key {key} slot {slot}: token {current['token']} after {previous['token']}")
    return found


# One millisecond of slack over the engine's microseconds (the rows' DATETIME(6) round trip).
RATE_SLACK_SECONDS = 0.001


def rated_starts(attempts: Iterable[Row], rules: KeyRules) -> dict[str, list[float]]:
    """The approved Starts (started_at) of each key with a rate, in time order."""
    starts: dict[str, list[float]] = collections.defaultdict(list)
    for attempt in attempts:
        if attempt["key"] and attempt["started_at"] is not None and rules.of_key(attempt["key"]).rate is not None:
            starts[attempt["key"]].append(attempt["started_at"])
    return {key: sorted(own) for key, own in starts.items()}


def key_starts_keep_their_rate(attempts: Iterable[Row], rules: KeyRules) -> list[str]:
    """GCRA replayed over each rated key's Starts: every Start came no earlier than the
    theoretical arrival time less the tolerance ((burst − 1)·T), so in any interval of
    length t at most burst + t / T Starts."""
    found = []
    for key, starts in rated_starts(attempts, rules).items():
        rule = rules.of_key(key)
        assert rule.rate is not None
        interval = rule.interval
        tolerance = (rule.rate[2] - 1) * interval
        tat: float | None = None
        for at in starts:
            if tat is not None and tat - tolerance > at + RATE_SLACK_SECONDS:
                found.append(
                    f"key {key} (rate {rule.rate}): a Start at {at:.6f} came {tat - tolerance - at:.6f} s "
                    "before the rate allowed it"
                )
            tat = max(tat, at) + interval if tat is not None else at + interval
    return found


def rated_window_figures(attempts: Iterable[Row], rules: KeyRules) -> dict[str, dict[str, Any]]:
    """A figure per rated key: its Starts, the most in any window of per_seconds (and the
    bound burst + per_seconds / T), and the rate achieved over its busiest run of Starts."""
    figures = {}
    for key, starts in rated_starts(attempts, rules).items():
        rule = rules.of_key(key)
        assert rule.rate is not None
        window = float(rule.rate[1])
        most, j = 0, 0
        for i, at in enumerate(starts):
            j = max(j, i)
            while j + 1 < len(starts) and starts[j + 1] <= at + window:
                j += 1
            most = max(most, j - i + 1)
        figures[key] = {
            "starts": len(starts),
            f"max_in_{window:g}_s": most,
            "bound": int(rule.rate[2] + (window + RATE_SLACK_SECONDS) // rule.interval),
        }
    return figures


def rated_windows_within_bound(attempts: Iterable[Row], rules: KeyRules) -> list[str]:
    return [
        f"key {key}: {figure[name]} Starts within {name} (bound {figure['bound']})"
        for key, figure in rated_window_figures(attempts, rules).items()
        for name in figure
        if name.startswith("max_in_") and figure[name] > figure["bound"]
    ]


def killed_worker_recovery_delays(killed_workers: Iterable[tuple[str, float]], attempts: Iterable[Row]) -> list[float]:
    """A figure, not a check: how long the attempts of a killed worker process stayed held,
    until the lease ran out and a server's sweep (or, for a same-id restart, the new
    process) ended them."""
    attempts = list(attempts)
    delays = []
    for worker_id, killed_wall in killed_workers:
        for attempt in attempts:
            if attempt["worker_id"] != worker_id or attempt["leased_at"] > killed_wall:
                continue
            if attempt["finished_at"] is not None and attempt["finished_at"] > killed_wall:
                delays.append(attempt["finished_at"] - killed_wall)
    return delays


# -- the workers' ledgers (reliability/worker.py) -------------------------------


@dataclass
class Ledgers:
    """What the workers' ledger files say: one entry per attempt a handler began or ended."""

    executions: dict[str, dict[str, Any]] = field(default_factory=dict)
    # attempts whose handler logged a start twice, in the order met
    started_twice: list[str] = field(default_factory=list)


def read_ledgers(directory: Path) -> Ledgers:
    ledgers = Ledgers()
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by kill -9
            entry = ledgers.executions.setdefault(record["attempt_id"], {"attempt_id": record["attempt_id"]})
            entry.update({k: record[k] for k in ("task_id", "key", "token", "worker_id", "idem", "pid")})
            if record["event"] == "start":
                if "start" in entry:
                    ledgers.started_twice.append(record["attempt_id"])
                entry["start"] = record["t"]
            else:
                entry["end"] = record["t"]
                entry["write"] = record.get("write")
                entry["lease_lost"] = record.get("lease_lost")
    return ledgers


def handlers_ran_once(ledgers: Ledgers) -> list[str]:
    return [f"attempt {attempt_id}: handler ran twice" for attempt_id in ledgers.started_twice]


def started_executions(ledgers: Ledgers) -> list[dict[str, Any]]:
    return [entry for entry in ledgers.executions.values() if "start" in entry]


def ledger_token(entry: Mapping[str, Any]) -> int | None:
    return int(entry["token"]) if entry["token"] is not None else None


def ledger_attempts_exist(ledgers: Ledgers, attempts: Mapping[str, Row]) -> list[str]:
    return [
        f"ledger attempt {entry['attempt_id']} is not in orbit_attempt"
        for entry in started_executions(ledgers)
        if entry["attempt_id"] not in attempts
    ]


def ledger_attempts_match_the_database(ledgers: Ledgers, attempts: Mapping[str, Row]) -> list[str]:
    """The task, key and token a handler was given are the attempt row's."""
    found = []
    for entry in started_executions(ledgers):
        attempt = attempts.get(entry["attempt_id"])
        if attempt is None:
            continue
        token = ledger_token(entry)
        if attempt["task_id"] != entry["task_id"] or (attempt["key"] or None) != entry["key"]:
            found.append(f"ledger attempt {entry['attempt_id']}: task/key differ from the database")
        if attempt["token"] != token:
            found.append(f"ledger attempt {entry['attempt_id']}: token {token} but database {attempt['token']}")
    return found


def handlers_begin_after_start_approved(ledgers: Ledgers, attempts: Mapping[str, Row]) -> list[str]:
    """Business code runs only once Orbit approved the attempt's Start."""
    found = []
    for entry in started_executions(ledgers):
        attempt = attempts.get(entry["attempt_id"])
        if attempt is None:
            continue
        if attempt["started_at"] is None or entry["start"] < attempt["started_at"] - 0.001:
            found.append(
                f"attempt {entry['attempt_id']}: handler began at {entry['start']:.6f} before Start was "
                f"approved ({attempt['started_at']})"
            )
    return found


def handler_end(entry: Mapping[str, Any], killed: Mapping[tuple[str, int], float]) -> float:
    """When the handler stopped: its logged end, else its worker process's kill -9, else never (inf)."""
    if "end" in entry:
        return entry["end"]
    return killed.get((entry["worker_id"], entry["pid"]), float("inf"))


def unended_handlers_were_killed(
    ledgers: Ledgers, attempts: Mapping[str, Row], killed: Mapping[tuple[str, int], float]
) -> list[str]:
    """A handler with no logged end belongs to a worker process the harness killed."""
    return [
        f"attempt {entry['attempt_id']}: handler never ended and its worker was not killed"
        for entry in started_executions(ledgers)
        if entry["attempt_id"] in attempts and handler_end(entry, killed) == float("inf")
    ]


def stale_writes_only_from_lost_leases(ledgers: Ledgers, attempts: Mapping[str, Row]) -> list[str]:
    """A write the fencing guard refused as stale belongs to an attempt that ended UNKNOWN."""
    found = []
    for entry in started_executions(ledgers):
        attempt = attempts.get(entry["attempt_id"])
        if attempt is None or entry.get("write") != "stale":
            continue
        if attempt["state"] != "UNKNOWN":
            found.append(
                f"attempt {entry['attempt_id']}: its write was refused as stale, yet it ended "
                f"{attempt['state']} (it held the permit while a newer token wrote)"
            )
    return found


# A permit: (key, slot), the slot None under capacity 1.
Permit = tuple[str, int | None]


def executions_by_slot(
    ledgers: Ledgers, attempts: Mapping[str, Row], killed: Mapping[tuple[str, int], float]
) -> dict[Permit, list[dict[str, Any]]]:
    """The keyed executions of known attempts, per permit (key, slot: the attempt row's,
    None under capacity 1) in the order they began, each with its end (handler_end) and its
    token as a number. Holders of different slots of one key run at once by design; one
    (key, slot) is the seed's mutex."""
    by_slot: dict[Permit, list[dict[str, Any]]] = collections.defaultdict(list)
    for entry in started_executions(ledgers):
        attempt = attempts.get(entry["attempt_id"])
        if attempt is not None and entry["key"]:
            by_slot[(entry["key"], attempt["slot"])].append(
                {**entry, "end": handler_end(entry, killed), "token_int": ledger_token(entry)}
            )
    for runs in by_slot.values():
        runs.sort(key=lambda e: e["start"])
    return by_slot


def fenced_overlaps(runs_by_slot: Mapping[Permit, list[dict[str, Any]]], attempts: Mapping[str, Row]) -> int:
    """A figure: overlapping executions of a permit where the first had lost its lease first (the token fences it)."""
    return len(list(_overlaps(runs_by_slot, attempts, lost_in_time=True)))


def key_executions_never_overlap_while_both_held_the_permit(
    runs_by_slot: Mapping[Permit, list[dict[str, Any]]], attempts: Mapping[str, Row]
) -> list[str]:
    return [
        f"key {key} slot {slot}: executions of {first['attempt_id']} ({attempts[first['attempt_id']]['state']}) "
        f"and {second['attempt_id']} overlapped while both held the permit"
        for (key, slot), first, second in _overlaps(runs_by_slot, attempts, lost_in_time=False)
    ]


def _overlaps(
    runs_by_slot: Mapping[Permit, list[dict[str, Any]]], attempts: Mapping[str, Row], lost_in_time: bool
) -> Iterable[tuple[Permit, dict[str, Any], dict[str, Any]]]:
    """The pairs of executions of a permit that ran at once, those whose first attempt ended
    UNKNOWN before the second was leased (lost_in_time) or the others."""
    for permit, runs in runs_by_slot.items():
        for i, first in enumerate(runs):
            for second in runs[i + 1 :]:
                if second["start"] >= first["end"]:
                    break
                a1, a2 = attempts[first["attempt_id"]], attempts[second["attempt_id"]]
                ended = a1["finished_at"]
                fenced = a1["state"] == "UNKNOWN" and ended is not None and ended <= a2["leased_at"]
                if fenced == lost_in_time:
                    yield permit, first, second


def key_executions_begin_in_token_order(runs_by_slot: Mapping[Permit, list[dict[str, Any]]]) -> list[str]:
    found = []
    for (key, slot), runs in runs_by_slot.items():
        for first, second in itertools.pairwise(runs):
            if second["token_int"] <= first["token_int"]:
                found.append(
                    f"key {key} slot {slot}: execution with token {second['token_int']} began after token "
                    f"{first['token_int']}"
                )
    return found

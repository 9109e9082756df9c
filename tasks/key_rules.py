"""What a key policy means for one key (SPEC §12): its capacity and its start
rate, resolved from the namespace's live policies (an exact key beats the
longest matching prefix, which beats the default: capacity 1, no rate), and
the GCRA arithmetic of the rate.

Every round reads the application row ahead of its transaction anyway; its
`key_policy_generation` says whether this process's copy of the namespace's
policies is still current, so a round reads the policies again only after one
changed (SPEC §10: configuration is read without a lock, and a change racing a
lease may order either way)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from tasks.models import ConcurrencyKey, KeyMatch, KeyPolicy

DEFAULT_CAPACITY = 1


@dataclass(frozen=True)
class Rate:
    """`starts` Starts per `per_seconds`, `burst` at once: GCRA with emission
    interval T = per_seconds / starts and tolerance (burst − 1)·T. Approved
    Starts of a key then number at most burst + t / T in any interval of length t."""

    starts: int
    per_seconds: int
    burst: int = 1

    @property
    def interval(self) -> timedelta:
        # Rounded up to the microsecond the database keeps: never faster than asked.
        return timedelta(microseconds=math.ceil(self.per_seconds * 1_000_000 / self.starts))

    @property
    def tolerance(self) -> timedelta:
        return self.interval * (self.burst - 1)

    def start_allowed(self, tat: datetime | None, now: datetime) -> bool:
        """Whether a Start at `now` keeps the bound (the Start's own check)."""
        return tat is None or tat - self.tolerance <= now

    def retry_after_ms(self, tat: datetime | None, now: datetime) -> int:
        if tat is None:
            return 1
        return max(1, math.ceil((tat - self.tolerance - now).total_seconds() * 1000))

    def after_start(self, tat: datetime | None, now: datetime) -> datetime:
        """The key's theoretical arrival time once a Start at `now` is approved."""
        return max(tat, now) + self.interval if tat is not None else now + self.interval

    def next_lease_at(self, tat: datetime | None, reserved: int, now: datetime) -> datetime:
        """The earliest time a lease may take one more attempt of the key
        (each leased, unstarted attempt holds a Start's room). Never later
        than the truth, so the scan's filter on it never hides a key with room."""
        base = max(tat, now) if tat is not None else now
        return base + self.interval * reserved - self.tolerance

    def lease_allowed(self, tat: datetime | None, reserved: int, now: datetime) -> bool:
        return self.next_lease_at(tat, reserved, now) <= now


@dataclass(frozen=True)
class KeyRule:
    """The capacity and rate one key has now, and the policy that gave them
    (None: the default)."""

    capacity: int = DEFAULT_CAPACITY
    rate: Rate | None = None
    policy_id: str | None = None


DEFAULT_RULE = KeyRule()


@dataclass(frozen=True)
class PolicySet:
    """A namespace's live policies, indexed for resolve()."""

    exact: dict[str, KeyRule] = field(default_factory=dict)
    prefixes: dict[str, KeyRule] = field(default_factory=dict)
    prefix_lengths: tuple[int, ...] = ()

    @classmethod
    def of(cls, policies: list[KeyPolicy]) -> PolicySet:
        exact: dict[str, KeyRule] = {}
        prefixes: dict[str, KeyRule] = {}
        for policy in policies:
            target = exact if policy.match_kind == KeyMatch.KEY else prefixes
            target[policy.match_value] = rule_of(policy)
        lengths = tuple(sorted({len(prefix) for prefix in prefixes}, reverse=True))
        return cls(exact, prefixes, lengths)

    @property
    def empty(self) -> bool:
        return not self.exact and not self.prefixes

    @property
    def rated(self) -> bool:
        """Whether any key of the namespace has a start rate."""
        return any(rule.rate is not None for rule in (*self.exact.values(), *self.prefixes.values()))

    def resolve(self, key: str) -> KeyRule:
        """The rule of one key. Keys and prefixes are compared as strings,
        which for UTF-8 is byte for byte: a string is a prefix of another
        exactly when its encoding is a prefix of the other's."""
        found = self.exact.get(key)
        if found is not None:
            return found
        for length in self.prefix_lengths:
            if length <= len(key):
                found = self.prefixes.get(key[:length])
                if found is not None:
                    return found
        return DEFAULT_RULE


NO_POLICIES = PolicySet()


def rule_of(policy: KeyPolicy) -> KeyRule:
    rate = None
    if policy.rate_starts is not None and policy.rate_per_seconds is not None:
        rate = Rate(policy.rate_starts, policy.rate_per_seconds, policy.rate_burst or 1)
    return KeyRule(capacity=policy.capacity, rate=rate, policy_id=policy.id)


def read_policy_set(namespace_id: str) -> PolicySet:
    return PolicySet.of(list(KeyPolicy.objects.filter(namespace_id=namespace_id, live=True)))


_cache_lock = threading.Lock()
_cache: dict[str, tuple[int, PolicySet]] = {}


def policies_of(namespace_id: str, generation: int) -> PolicySet:
    """The namespace's policies as of its application's `generation` (read
    again only when it moved; 0: no policy was ever made in the application)."""
    if generation == 0:
        return NO_POLICIES
    cached = _cache.get(namespace_id)
    if cached is not None and cached[0] == generation:
        return cached[1]
    policies = read_policy_set(namespace_id)
    with _cache_lock:
        current = _cache.get(namespace_id)
        if current is None or current[0] < generation:
            _cache[namespace_id] = (generation, policies)
    return policies


def cache_rule(row: ConcurrencyKey, rule: KeyRule, now: datetime) -> list[str]:
    """Writes the rule's capacity and rate state into the key row's cached
    columns (what the lease's scan filters on), and brings an arrival time a
    slower rate left back to the rule's, in memory; returns the fields that
    changed. Callers hold the row's lock."""
    changed = []
    if rule.rate is not None and row.rate_tat is not None:
        # A rate's own Starts never leave the key's arrival time more than burst
        # intervals ahead of now, so this is a no-op under an unchanged rate. One
        # left further ahead by a slower rate since raised is brought back to the
        # new rate, as if the key had spent its whole burst at the change: the
        # key is then held to the rate it has, not the one it had (SPEC §12).
        latest = now + rule.rate.interval * rule.rate.burst
        if row.rate_tat > latest:
            row.rate_tat = latest
            changed.append("rate_tat")
    next_start_at = rule.rate.next_lease_at(row.rate_tat, row.rate_reserved, now) if rule.rate is not None else None
    if row.capacity != rule.capacity:
        row.capacity = rule.capacity
        changed.append("capacity")
    if row.next_start_at != next_start_at:
        row.next_start_at = next_start_at
        changed.append("next_start_at")
    return changed

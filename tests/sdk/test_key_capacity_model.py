"""orbit_sdk.ConcurrencyKey of a key with a policy (SPEC §12): capacity, holders by slot, the
policy and the rate state, as GET /v1/concurrency-keys/{key} answers them; a key of capacity 1
reads as before."""

from __future__ import annotations

import datetime

import pytest

from orbit_sdk import ConcurrencyKey, ConcurrencyKeyHolder, KeyRate, ProtocolError

SINCE = "2026-12-03T12:00:00.000000Z"
A, T = "a" * 32, "b" * 32


def holder(slot: int, token: str) -> dict:
    return {"slot": slot, "attempt_id": A, "task_id": T, "worker_id": "w", "token": token, "since": SINCE}


def test_a_key_of_capacity_3_reads_its_holders_policy_and_rate() -> None:
    key = ConcurrencyKey.from_json(
        {
            "key": "printer/1",
            "capacity": 3,
            "policy_id": "c" * 32,
            "rate": {"starts": 10, "per_seconds": 1, "burst": 5},
            "reserved_starts": 2,
            "next_start_at": SINCE,
            "holders": [holder(0, "5"), holder(2, "18446744073709551615")],
            "highest_token": "18446744073709551615",
            "waiting_tasks": 4,
            "updated_at": SINCE,
        }
    )
    assert key.capacity == 3 and key.policy_id == "c" * 32 and key.holder is None
    assert key.rate == KeyRate(starts=10, per_seconds=1, burst=5) and key.reserved_starts == 2
    assert key.next_start_at == datetime.datetime(2026, 12, 3, 12, tzinfo=datetime.UTC)
    assert [(h.slot, h.token) for h in key.holders] == [(0, 5), (2, 2**64 - 1)]
    assert isinstance(key.holders[0], ConcurrencyKeyHolder) and key.holders[0].worker_id == "w"


def test_a_key_of_capacity_1_reads_as_before() -> None:
    seed = {"attempt_id": A, "task_id": T, "token": "3", "since": SINCE}
    key = ConcurrencyKey.from_json({"key": "m", "holder": seed, "highest_token": "3", "waiting_tasks": 0})
    assert key.capacity == 1 and key.holders == () and key.holder is not None and key.holder.slot is None
    assert key.rate is None and key.policy_id is None and key.next_start_at is None


@pytest.mark.parametrize(
    "bad", [{"holders": {"slot": 0}}, {"holders": [{"slot": 0}]}, {"rate": {"starts": "x", "per_seconds": 1}}]
)
def test_a_malformed_key_is_a_protocol_error(bad: dict) -> None:
    with pytest.raises(ProtocolError):
        ConcurrencyKey.from_json({"key": "k", "highest_token": "0", "waiting_tasks": 0, **bad})

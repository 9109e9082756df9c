"""execution.concurrency_slot (SPEC §12): the assignment's concurrency_slot of a key of capacity
above 1, None when absent (capacity 1, the seed's assignment); checked like the token."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

import orbit_sdk
from orbit_sdk import ProtocolError, fencing
from orbit_sdk._attempts import Execution
from orbit_sdk._protocol import changes, parse_assignment

NS = "00112233445566778899aabbccddeeff"
TASK = {"id": "t1", "queue_id": "q", "handler": "h", "handler_version": "v1", "payload_version": "v1"}


def frame(**extra: Any) -> dict[str, Any]:
    task = {**TASK, "payload": {}, "priority": 5, "concurrency_key": "printer/1"}
    return {"attempt_id": "a1", "epoch": 1, "concurrency_token": "12", "task": task, **extra}


def execution_of(assignment_frame: dict[str, Any]) -> Execution:
    worker = orbit_sdk.Worker("http://h", "t", ["q"], {"h": lambda e: None}, namespace_id=NS)
    expires = datetime.datetime(2030, 1, 2, tzinfo=datetime.UTC)
    return Execution(worker, parse_assignment(assignment_frame, concurrency_keys=True), 1, expires)


def test_the_slot_reaches_the_execution_and_its_fence() -> None:
    run = execution_of(frame(concurrency_slot=2))
    assert run.concurrency_slot == 2 and run.concurrency_token == 12
    assert run.fence_headers("op")[fencing.HEADER_SLOT] == "2"


def test_without_a_slot_the_execution_is_the_seeds() -> None:
    run = execution_of(frame())
    assert run.concurrency_slot is None
    assert fencing.HEADER_SLOT not in run.fence_headers("op")
    unkeyed = {"attempt_id": "a1", "epoch": 1, "task": {**TASK, "payload": {}, "priority": 5}}
    assert execution_of(unkeyed).concurrency_slot is None


@pytest.mark.parametrize("slot", [-1, "1", 1.5, True])
def test_a_bad_slot_is_a_protocol_error(slot: Any) -> None:
    with pytest.raises(ProtocolError):
        parse_assignment(frame(concurrency_slot=slot), concurrency_keys=True)


def test_a_slot_without_a_key_is_a_protocol_error() -> None:
    unkeyed = {"attempt_id": "a1", "epoch": 1, "task": {**TASK, "payload": {}, "priority": 5}, "concurrency_slot": 0}
    with pytest.raises(ProtocolError, match="concurrency_slot"):
        parse_assignment(unkeyed, concurrency_keys=True)


def test_a_repeated_assignment_may_not_move_the_slot() -> None:
    known = parse_assignment(frame(concurrency_slot=1), concurrency_keys=True)
    moved = parse_assignment(frame(concurrency_slot=2), concurrency_keys=True)
    assert changes(known, moved) == "attempt a1: concurrency_slot changed from 1 to 2"
    assert changes(known, parse_assignment(frame(concurrency_slot=1), concurrency_keys=True)) is None

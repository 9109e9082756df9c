"""orbit_sdk.Worker against tests/support/fake_server.py, a scripted server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

import orbit_sdk
from orbit_sdk import _attempts
from orbit_sdk._attempts import NO_HANDLER_HOLD_SECONDS
from orbit_sdk._protocol import websocket_url
from orbit_sdk._worker import default_worker_id
from tests.support.fake_server import FakeAttempt, FakeServer
from tests.support.sdk_worker import TOKEN, make_worker, recv_types, run, running

SECRET = TOKEN.rsplit("_", 1)[1]  # the secret part of the bearer token


def without_id(frame: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in frame.items() if k != "id"}


@pytest.fixture
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_attempts, "QUEUE_PAUSED_BACKOFF", 0.02)
    monkeypatch.setattr(_attempts, "TRANSIENT_BACKOFF", 0.02)


# --------------------------------------------------------------------------- basics


def test_websocket_url_and_default_worker_id():
    assert websocket_url("http://h:8080") == "ws://h:8080/v1/workers/connect"
    assert websocket_url("https://h/prefix/") == "wss://h/prefix/v1/workers/connect"
    with pytest.raises(ValueError):
        websocket_url("ftp://h")
    worker = orbit_sdk.Worker("http://h", TOKEN, ["q1"], {"echo": lambda e: None})
    assert worker.worker_id == worker.worker_id and worker.worker_id.count("-") >= 2
    assert default_worker_id() != default_worker_id()  # a random part per Worker object


def test_hello_then_start_before_handler_then_result():
    async def scenario():
        async with FakeServer() as server:

            def handler(execution):
                server.events.append(f"handler:{execution.attempt_id}")
                return {"echo": execution.payload, "number": execution.attempt_number}

            worker = make_worker(server, {("echo", "v1"): handler}, capacity=2)
            server.assign("a1", payload={"x": 1}, business_key="order-9")
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].result is not None)

            hello = without_id(server.received("hello")[0])
            assert hello == {
                "type": "hello",
                "worker_id": "w1",
                "queues": ["q1"],
                "capacity": 2,
                "handlers": [{"handler": "echo", "handler_version": "v1"}],
                "concurrency_keys": True,
                "version": "orbit-python/0.1",
            }
            assert server.auth_headers == [f"Bearer {TOKEN}"]
            # the Start acknowledges the assignment: no task.assign.ack (docs/protocol.md)
            assert recv_types(server) == ["hello", "task.start", "task.result"]
            assert server.events == ["start:a1", "start.ok:a1", "handler:a1"]
            assert without_id(server.received("task.result")[0]) == {
                "type": "task.result",
                "attempt_id": "a1",
                "epoch": 1,
                "outcome": "SUCCEEDED",
                "retryable": False,
                "output": {"echo": {"x": 1}, "number": 1},
                # its slot is free again: what the answer hands on may arrive started
                "start_next": True,
            }
            ids = [frame["id"] for direction, frame in server.log if direction == "recv"]
            assert len(ids) == len(set(ids))

    run(scenario)


def nested(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_outcomes_of_sync_and_async_handlers(kind):
    class Boom(Exception):
        pass

    def decide(payload):
        match payload["case"]:
            case "ok":
                return {"done": True}
            case "none":
                return None
            case "retry":
                raise orbit_sdk.RetryableError("try later")
            case "unknown":
                raise orbit_sdk.UnknownOutcome("maybe")
            case "boom":
                raise Boom("bad input")
            case "unserializable":
                return {"when": object()}
            case "nan":
                return {"ratio": float("nan")}
            case "twenty deep":
                return nested(20)
            case "too deep":
                return nested(21)
            case "too big":
                return "x" * 1_000_001
            case "surrogate":
                return {"s": "\ud800"}
            case "long message":
                raise Boom("m" * 10_000)

    threads: list[int] = []

    def sync_handler(execution):
        threads.append(threading.get_ident())
        return decide(execution.payload)

    async def async_handler(execution):
        threads.append(threading.get_ident())
        await asyncio.sleep(0)
        return decide(execution.payload)

    async def scenario():
        async with FakeServer() as server:
            handler = sync_handler if kind == "sync" else async_handler
            worker = make_worker(server, {("echo", "v1"): handler}, capacity=6)
            cases = ["ok", "none", "retry", "unknown", "boom", "unserializable", "nan", "twenty deep", "too deep"]
            cases += ["too big", "surrogate", "long message"]
            for case in cases:
                server.assign(case, payload={"case": case})
            async with running(worker):
                await server.wait_for(lambda: all(server.attempts[c].result for c in cases))
                loop_thread = threading.get_ident()

            def result(case):
                frame = server.attempts[case].result
                return {k: frame.get(k) for k in ("outcome", "retryable", "output", "error")}

            assert result("ok") == {"outcome": "SUCCEEDED", "retryable": False, "output": {"done": True}, "error": None}
            assert "output" not in server.attempts["none"].result
            assert result("retry") == {
                "outcome": "FAILED",
                "retryable": True,
                "output": None,
                "error": {"type": "RetryableError", "message": "try later"},
            }
            assert result("unknown")["outcome"] == "UNKNOWN"
            assert result("unknown")["error"] == {"type": "UnknownOutcome", "message": "maybe"}
            assert result("boom") == {
                "outcome": "FAILED",
                "retryable": False,
                "output": None,
                "error": {"type": "Boom", "message": "bad input"},
            }
            assert result("unserializable")["outcome"] == "UNKNOWN"
            assert result("unserializable")["error"]["type"] == "OutputNotSerializable"
            for case in ("nan", "too deep", "too big", "surrogate"):  # what the server would refuse: unknown outcome
                assert result(case)["outcome"] == "UNKNOWN"
                assert result(case)["error"]["type"] == "OutputNotSerializable"
            assert (
                result("too deep")["error"]["message"] == "handler output is not JSON: nested more than 20 levels deep"
            )
            assert result("twenty deep") == {
                "outcome": "SUCCEEDED",
                "retryable": False,
                "output": nested(20),
                "error": None,
            }
            if kind == "sync":
                assert loop_thread not in threads
            else:
                assert set(threads) == {loop_thread}

    run(scenario)


# --------------------------------------------------------------------------- start


def test_rate_limited_start_is_retried_with_same_attempt_and_epoch():
    calls = []

    async def scenario():
        async with FakeServer(renew_seconds=0.05) as server:
            limited = {"type": "error", "code": "RATE_LIMITED", "message": "rate", "retry_after_ms": 150}
            server.start_replies["a1"] = [dict(limited), dict(limited)]
            worker = make_worker(server, {("echo", "v1"): lambda e: calls.append(e.attempt_id)})
            server.assign("a1", epoch=4)
            began = time.monotonic()
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].result is not None)
            elapsed = time.monotonic() - began

            starts = server.received("task.start", "a1")
            assert [without_id(f) for f in starts] == [{"type": "task.start", "attempt_id": "a1", "epoch": 4}] * 3
            assert calls == ["a1"]
            assert elapsed >= 0.3
            # The lease is renewed while waiting for the rate window.
            first_start = server.log.index(("recv", starts[0]))
            last_start = server.log.index(("recv", starts[-1]))
            renews = [f for d, f in server.log[first_start:last_start] if d == "recv" and f["type"] == "task.renew"]
            assert renews and all(f["epoch"] == 4 for f in renews)

    run(scenario)


@pytest.mark.parametrize("code", ["LEASE_LOST", "TASK_CANCELLED"])
def test_start_refused_drops_the_attempt(code):
    calls = []

    async def scenario():
        async with FakeServer() as server:
            server.start_replies["a1"] = [{"type": "error", "code": code, "message": "no"}]
            worker = make_worker(server, {("echo", "v1"): lambda e: calls.append(1)})
            server.assign("a1")
            server.attempts["a1"].state = "EXPIRED" if code == "LEASE_LOST" else "CANCELLED"
            async with running(worker) as task:
                await server.wait_for(lambda: server.received("task.start"))
                worker.drain()
                await asyncio.wait_for(task, 1.0)  # nothing left to wait for
            assert calls == []
            assert server.received("task.result") == [] and server.received("task.release") == []

    run(scenario)


def test_queue_paused_start_is_retried_then_runs(fast_backoff):
    calls = []

    async def scenario():
        async with FakeServer() as server:
            paused = {"type": "error", "code": "QUEUE_PAUSED", "message": "paused"}
            server.start_replies["a1"] = [dict(paused), dict(paused)]
            worker = make_worker(server, {("echo", "v1"): lambda e: calls.append(1)})
            server.assign("a1")
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].result is not None)
            assert len(server.received("task.start", "a1")) == 3
            assert calls == [1]

    run(scenario)


def test_queue_paused_longer_than_a_lease_hands_the_attempt_back(fast_backoff):
    calls = []

    async def scenario():
        async with FakeServer(lease_seconds=0.3, renew_seconds=0.1) as server:
            server.start_replies["a1"] = [{"type": "error", "code": "QUEUE_PAUSED", "message": "p"}] * 100
            worker = make_worker(server, {("echo", "v1"): lambda e: calls.append(1)})
            server.assign("a1")
            async with running(worker):
                await server.wait_for(lambda: server.received("task.release", "a1"))
            release = without_id(server.received("task.release", "a1")[0])
            assert release == {"type": "task.release", "attempt_id": "a1", "epoch": 1, "reason": "queue paused"}
            assert calls == []
            assert len(server.received("task.start", "a1")) >= 3

    run(scenario)


# --------------------------------------------------------------------------- results and reconnects


def test_result_is_resent_when_the_reply_is_dropped():
    calls = []

    async def scenario():
        async with FakeServer() as server:
            server.result_actions = ["drop"]
            worker = make_worker(server, {("echo", "v1"): lambda e: calls.append(1) or "out"}, request_timeout=0.2)
            server.assign("a1")
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].results_received >= 2)
                await server.wait_for(lambda: not worker._attempts.held)  # acknowledged
            results = [without_id(f) for f in server.received("task.result", "a1")]
            assert len(results) == 2 and results[0] == results[1]
            assert calls == [1]
            assert server.connections == 1

    run(scenario)


@pytest.mark.parametrize("action", ["close", "close_after"])
def test_result_is_resent_across_a_reconnect(action):
    calls = []

    async def scenario():
        async with FakeServer() as server:
            server.result_actions = [action]
            worker = make_worker(server, {("echo", "v1"): lambda e: calls.append(1) or "out"})
            server.assign("a1")
            async with running(worker):
                await server.wait_for(lambda: len(server.received("task.result", "a1")) >= 2)
                await server.wait_for(lambda: not worker._attempts.held)
            assert server.connections == 2
            assert [h["worker_id"] for h in server.received("hello")] == ["w1", "w1"]
            results = [without_id(f) for f in server.received("task.result", "a1")]
            assert len(results) == 2 and results[0] == results[1]
            if action == "close":  # still held after the reconnect: resumed before the result goes again
                types = recv_types(server)
                assert types[types.index("hello", 1) :] == ["hello", "task.resume", "task.result"]
            assert calls == [1]

    run(scenario)


@pytest.mark.parametrize("nested", [True, False])
def test_reconnect_resumes_a_running_attempt_with_its_key_and_token(nested):
    seen: list[tuple[Any, ...]] = []

    async def scenario():
        async with FakeServer(resume_nested=nested) as server:
            release = asyncio.Event()

            async def handler(execution):
                seen.append((execution.attempt_id, execution.concurrency_key, execution.concurrency_token))
                await release.wait()
                return {"token": str(execution.concurrency_token)}

            worker = make_worker(server, {("echo", "v1"): handler})
            server.assign("a1", key="object/42", token="18446744073709551615")
            async with running(worker):
                await server.wait_for(lambda: seen)
                await server.close_connection()
                await server.wait_for(lambda: server.received("task.resume"))
                await server.wait_for(lambda: worker._link.conn is not None and worker._link.conn.ready)
                release.set()
                await server.wait_for(lambda: server.attempts["a1"].result is not None)

            assert seen == [("a1", "object/42", 2**64 - 1)]
            assert without_id(server.received("task.resume")[0]) == {
                "type": "task.resume",
                "attempt_id": "a1",
                "epoch": 1,
            }
            assert server.attempts["a1"].result["output"] == {"token": "18446744073709551615"}
            assert len(server.received("task.start")) == 1
            assert server.received("task.release") == []

    run(scenario)


def test_attempt_missing_from_held_after_reconnect_is_dropped_before_start():
    calls = []

    async def scenario():
        async with FakeServer() as server:
            server.start_replies["a1"] = [{"type": "error", "code": "RATE_LIMITED", "retry_after_ms": 300}]
            worker = make_worker(server, {("echo", "v1"): lambda e: calls.append(1)})
            server.assign("a1")
            async with running(worker):
                await server.wait_for(lambda: server.received("task.start"))
                server.attempts["a1"].state = "EXPIRED"  # the lease ran out while we were away
                await server.close_connection()
                await server.wait_for(lambda: server.connections == 2 and not worker._attempts.held)
            assert calls == []
            assert server.received("task.resume") == []
            assert len(server.received("task.start")) == 1

    run(scenario)


def test_running_attempt_of_an_earlier_process_is_reported_unknown_and_leased_one_released():
    calls = []

    async def scenario():
        async with FakeServer() as server:
            running_frame = server.assign("r1")
            leased_frame = server.assign("l1")
            server._queued.clear()  # never delivered to this process: only in `held`
            server.attempts["r1"] = FakeAttempt(frame=running_frame, worker_id="w1", state="RUNNING", attempt_number=1)
            server.attempts["l1"] = FakeAttempt(frame=leased_frame, worker_id="w1", state="LEASED")
            worker = make_worker(server, {("echo", "v1"): lambda e: calls.append(1)})
            async with running(worker):
                await server.wait_for(lambda: server.attempts["r1"].result and server.attempts["l1"].release_reason)
            assert server.attempts["r1"].result["outcome"] == "UNKNOWN"
            assert server.attempts["r1"].result["error"]["type"] == "WorkerRestarted"
            assert server.attempts["l1"].release_reason == "not held by this worker process"
            assert calls == [] and server.received("task.start") == []

    run(scenario)


# --------------------------------------------------------------------------- renewals and cancellation


def test_cancel_requested_reaches_a_sync_handler(caplog):
    outcome: dict[str, Any] = {}

    def handler(execution):
        outcome["before"] = execution.cancel_requested
        outcome["waited"] = execution.wait_cancelled(timeout=2.0)
        outcome["after"] = execution.cancel_requested
        execution.raise_if_cancelled()

    async def scenario():
        async with FakeServer(renew_seconds=0.05) as server:
            worker = make_worker(server, {("echo", "v1"): handler})
            server.assign("a1")
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].state == "RUNNING")
                server.attempts["a1"].cancel_requested = True
                await server.wait_for(lambda: server.attempts["a1"].result is not None)
            assert outcome == {"before": False, "waited": True, "after": True}
            result = server.attempts["a1"].result
            assert (result["outcome"], result["retryable"], result["error"]["type"]) == (
                "FAILED",
                False,
                "CancelRequested",
            )

    with caplog.at_level("INFO", logger="orbit_sdk"):
        run(scenario)
    # stopping as asked is not a crash: one line, no traceback
    stopped = [r for r in caplog.records if "stopped" in r.getMessage()]
    assert len(stopped) == 1 and stopped[0].levelname == "INFO" and stopped[0].exc_info is None
    assert not any(r.exc_info for r in caplog.records)


def test_lease_lost_on_renew_signals_an_async_handler_and_the_result_still_goes():
    seen: dict[str, Any] = {}

    async def handler(execution):
        await execution.until_cancelled()
        seen.update(lease_lost=execution.lease_lost, cancel_requested=execution.cancel_requested)
        return "late"

    async def scenario():
        async with FakeServer(renew_seconds=0.05) as server:
            server.renew_replies["a1"] = [{"type": "error", "code": "LEASE_LOST", "message": "gone"}]
            worker = make_worker(server, {("echo", "v1"): handler})
            server.assign("a1")
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].result is not None)
            assert seen == {"lease_lost": True, "cancel_requested": False}
            assert server.attempts["a1"].result["output"] == "late"

    run(scenario)


REFUSED_RENEWALS = [("UNAVAILABLE", 4), ("INTERNAL", 4), ("INVALID_ARGUMENT", 3)]


@pytest.fixture(scope="module")
def renewals_sent_under_refusal() -> dict[str, int]:
    """task.renew frames sent in 2.6 s of refusals, by refusal code. Each code's scenario only
    waits (its own FakeServer and worker, TRANSIENT_BACKOFF as shipped), so the three wait out
    their 2.6 s side by side in one event loop, once for the module, not once per case."""

    async def scenario(code: str) -> int:
        async with FakeServer(lease_seconds=30, renew_seconds=1.0) as server:
            refusal = {"type": "error", "code": code, "message": "not now"}
            server.renew_replies["a1"] = [dict(refusal) for _ in range(100)]
            worker = make_worker(server, {("echo", "v1"): lambda execution: execution.wait_cancelled(2.6)})
            server.assign("a1")
            async with running(worker):
                await asyncio.sleep(2.6)  # the first renewal is due after 1 s; 1.6 s of refusals follow
            return len(server.received("task.renew", "a1"))

    async def side_by_side() -> dict[str, int]:
        counts = await asyncio.gather(*(scenario(code) for code, _ in REFUSED_RENEWALS))
        return {code: count for (code, _), count in zip(REFUSED_RENEWALS, counts, strict=True)}

    return run(side_by_side, timeout=6)


@pytest.mark.parametrize(("code", "most"), REFUSED_RENEWALS)
def test_a_refused_renewal_is_not_sent_again_on_every_tick(
    code: str, most: int, renewals_sent_under_refusal: dict[str, int]
):
    """A renewal answered "not now" (UNAVAILABLE, INTERNAL: the server is overloaded, a cell
    moving) is asked again after a doubling delay, as a Start refused so is; any other
    unexpected answer is logged and the renewal waits for its next turn. Either way the server
    that refused is not asked four times a second per held attempt."""
    renewals = renewals_sent_under_refusal[code]
    assert 1 <= renewals <= most, f"{renewals} renewals in 1.6 s of {code} answers"


def test_a_renewal_refused_unavailable_is_still_asked_again_before_the_lease_ends(monkeypatch):
    """The backoff after a renewal answered UNAVAILABLE never waits past a third of what is
    left of the lease: however long the backoff has grown, a renewal goes out before the lease
    ends, more often as its end nears."""
    monkeypatch.setattr(_attempts, "TRANSIENT_BACKOFF", 20.0)  # a backoff longer than the lease

    async def scenario() -> list[float]:
        async with FakeServer(lease_seconds=30, renew_seconds=30) as server:
            server.renew_replies["a1"] = [{"type": "error", "code": "UNAVAILABLE", "message": "busy"}] * 100
            ends = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=3)
            lease = ends.isoformat().replace("+00:00", "Z")
            worker = make_worker(server, {("echo", "v1"): lambda execution: execution.wait_cancelled(3)})
            server.assign("a1", started=True, extra={"lease_expires_at": lease})
            started = time.monotonic()
            sent: list[float] = []
            async with running(worker):
                while time.monotonic() - started < 2.9:
                    if len(server.received("task.renew", "a1")) > len(sent):
                        sent.append(time.monotonic() - started)
                    await asyncio.sleep(0.01)
            return sent

    sent = run(scenario, timeout=6)
    # A third of the 3 s lease first (≈1 s), then within a third of what is left each time.
    assert len(sent) >= 3, sent
    assert all(later - earlier < 1.0 for earlier, later in zip(sent, sent[1:], strict=False)), sent


# --------------------------------------------------------------------------- start ahead


def test_a_started_assignment_runs_at_once_without_a_start():
    def handler(execution):
        return {"number": execution.attempt_number, "token": execution.concurrency_token}

    async def scenario():
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): handler})
            server.assign("a1", key="object/1", token="41", started=True)
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].result is not None)
            # no task.start: the Start went ahead with the result before; acknowledged before
            # the handler ran, so the server never takes back a Start whose handler runs
            assert recv_types(server) == ["hello", "task.assign.ack", "task.result"]
            result = without_id(server.received("task.result")[0])
            assert result["output"] == {"number": 1, "token": 41}
            assert result["start_next"] is True

    run(scenario)


def test_a_draining_worker_asks_no_start_ahead_but_runs_a_started_assignment():
    gate = threading.Event()

    def handler(execution):
        assert gate.wait(2.0)
        return execution.attempt_id

    async def scenario():
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): handler}, capacity=2)
            server.assign("a1")
            async with running(worker) as task:
                await server.wait_for(lambda: server.attempts["a1"].state == "RUNNING")
                worker.drain()
                await server.wait_for(lambda: server.received("drain"))
                # handed on with an earlier result's answer, before drain.ok: it is running work
                server.assign("a2", started=True)
                gate.set()
                await asyncio.wait_for(task, 1.5)
            assert server.attempts["a2"].result["output"] == "a2"
            assert server.attempts["a2"].release_reason is None
            assert all("start_next" not in frame for frame in server.received("task.result"))

    run(scenario)


def test_a_started_assignment_it_cannot_run_is_handed_back_unacknowledged():
    async def scenario():
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): lambda execution: "ran"})
            server.assign("a1", handler="other", started=True)
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].release_reason is not None)
            # never acknowledged, so its Start is the server's to take back: no result, no run
            assert server.attempts["a1"].release_reason == "no handler"
            assert not server.received("task.assign.ack") and not server.received("task.result")

    run(scenario)


PAST = "2020-01-01T00:00:00Z"  # a lease that ended before the frame was read


def test_a_started_assignment_read_after_its_lease_ended_is_handed_back_not_run():
    # As after a SIGSTOP: the frame waited in the socket while the server took the attempt back
    # and gave the key a newer token; running it now would begin business code out of token order.
    calls = []

    async def scenario():
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): lambda execution: calls.append(1)})
            server.assign("a1", key="object/1", token="9", started=True, extra={"lease_expires_at": PAST})
            server.assign("a2", key="object/1", token="10", started=True)
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a2"].result is not None)
                await server.wait_for(lambda: server.attempts["a1"].release_reason is not None)
            assert server.attempts["a1"].release_reason == "lease over before the assignment was read"
            assert [f["attempt_id"] for f in server.received("task.assign.ack")] == ["a2"]
            assert [f["attempt_id"] for f in server.received("task.result")] == ["a2"]
            assert calls == [1]

    run(scenario)


def test_a_start_approved_past_its_lease_does_not_run_the_handler():
    calls = []

    async def scenario():
        async with FakeServer() as server:
            approved = {"type": "task.start.ok", "attempt_number": 1, "lease_expires_at": PAST}
            server.start_replies["a1"] = [approved]
            worker = make_worker(server, {("echo", "v1"): lambda execution: calls.append(1)})
            server.assign("a1")
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].result is not None)
            result = without_id(server.received("task.result")[0])
            assert result["outcome"] == "FAILED" and result["retryable"] is True
            assert result["error"] == {"type": "NotRun", "message": "lease lost before the handler started"}
            assert calls == []

    run(scenario)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_handler_whose_lease_ends_before_it_begins_is_not_called(kind):
    # The last check runs where the handler begins (its own thread, for a sync handler): a
    # process stopped between the Start and that point must not begin it once resumed.
    calls = []

    def sync_handler(execution):
        calls.append(1)

    async def async_handler(execution):
        calls.append(1)

    async def scenario():
        async with FakeServer() as server:
            handler = sync_handler if kind == "sync" else async_handler
            worker = make_worker(server, {("echo", "v1"): handler})
            server.assign("a1", started=True)
            original = _attempts.Execution.__init__

            def stale_execution(self, *args, **kwargs):
                original(self, *args, **kwargs)
                self.lease_expires_at = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(_attempts.Execution, "__init__", stale_execution)
                async with running(worker):
                    await server.wait_for(lambda: server.attempts["a1"].result is not None)
            result = without_id(server.received("task.result")[0])
            assert result["outcome"] == "FAILED" and result["retryable"] is True
            assert result["error"]["type"] == "NotRun"
            assert "lease over before the handler began" in result["error"]["message"]
            assert calls == []

    run(scenario)


# --------------------------------------------------------------------------- drain


def test_drain_from_another_thread_lets_running_work_finish_and_report():
    gate = threading.Event()

    def handler(execution):
        assert gate.wait(2.0)
        return "finished"

    async def scenario():
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): handler})
            server.assign("a1")
            async with running(worker) as task:
                await server.wait_for(lambda: server.attempts["a1"].state == "RUNNING")
                threading.Thread(target=worker.drain).start()
                await server.wait_for(lambda: server.received("drain"))
                assert not task.done()
                gate.set()
                await asyncio.wait_for(task, 1.5)  # ends by itself once the result is acknowledged
            assert server.attempts["a1"].result["output"] == "finished"
            assert recv_types(server) == ["hello", "task.start", "drain", "task.result"]
            assert worker.join(0)

    run(scenario)


def test_drain_from_a_handler_and_unstarted_attempts_are_released():
    def handler(execution):
        execution.worker.drain()
        return "bye"

    async def scenario():
        async with FakeServer() as server:
            server.start_replies["a2"] = [{"type": "error", "code": "RATE_LIMITED", "retry_after_ms": 10_000}]
            worker = make_worker(server, {("echo", "v1"): handler}, capacity=2)
            server.assign("a2")
            async with running(worker) as task:
                await server.wait_for(lambda: server.received("task.start", "a2"))
                server.assign("a1")
                await asyncio.wait_for(task, 2.0)
            assert server.attempts["a1"].result["output"] == "bye"
            assert server.attempts["a2"].release_reason == "draining"
            assert len(server.received("task.start", "a2")) == 1

    run(scenario)


def test_drain_before_run_returns_without_work():
    async def scenario():
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): lambda e: None})
            worker.drain()
            await asyncio.wait_for(worker.run_async(), 1.0)

    run(scenario)


# --------------------------------------------------------------------------- handlers


def test_bare_handler_names_are_advertised_without_a_version_and_unknown_handlers_are_released():
    calls = []

    async def scenario():
        async with FakeServer() as server:
            worker = make_worker(server, {"echo": lambda e: calls.append(e.task.handler_version)})
            server.assign("a1", version="v7")
            server.assign("a2", handler="other")
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].result and server.attempts["a2"].release_reason)
            assert server.received("hello")[0]["handlers"] == [{"handler": "echo"}]
            assert calls == ["v7"]
            assert server.attempts["a2"].release_reason == "no handler"
            assert server.received("task.start", "a2") == []

    run(scenario)


def test_bare_names_and_exact_pairs_are_advertised_together():
    async def scenario():
        async with FakeServer() as server:
            handlers = {"echo": lambda e: None, ("resize", "v2"): lambda e: None, ("echo", "v1"): lambda e: None}
            async with running(make_worker(server, handlers)):
                await server.wait_for(lambda: server.received("hello"))
            assert server.received("hello")[0]["handlers"] == [
                {"handler": "echo"},
                {"handler": "resize", "handler_version": "v2"},
            ]

    run(scenario)


def test_a_task_no_handler_serves_is_handed_back_after_a_hold_not_at_once(caplog):
    # given a worker that is assigned tasks it has no handler for (a server that ignores its list)
    async def scenario():
        async with FakeServer() as server:
            worker = make_worker(server, {"echo": lambda e: None})
            server.assign("a1", handler="other")
            server.assign("a2", handler="other")
            async with running(worker):
                # when it is assigned tasks of another handler
                began = time.monotonic()
                await server.wait_for(lambda: server.attempts["a2"].release_reason)
                held_for = time.monotonic() - began
        # then each is released after the hold (not straight back into a lease/release loop)
        assert held_for >= NO_HANDLER_HOLD_SECONDS * 0.9
        assert {server.attempts[a].release_reason for a in ("a1", "a2")} == {"no handler"}

    with caplog.at_level(logging.WARNING, logger="orbit_sdk"):
        run(scenario)
    # and the misconfiguration is logged once, naming the handler
    warnings = [r.getMessage() for r in caplog.records if "no handler for" in r.getMessage()]
    assert len(warnings) == 1 and "other v1" in warnings[0]


# --------------------------------------------------------------------------- protocol errors


@pytest.mark.parametrize(
    ("assignment", "concurrency_keys", "message"),
    [
        ({"key": "object/1"}, True, "keyed task without concurrency_token"),
        ({"token": "5"}, True, "concurrency_token without a concurrency key"),
        ({"extra": {"concurrency_token": None}}, True, "canonical uint64"),
        ({"key": "object/1", "token": "5"}, False, "did not ask for concurrency_keys"),
        ({"key": "object/1", "token": 5}, True, "canonical uint64"),
        ({"key": "object/1", "token": "017"}, True, "canonical uint64"),
        ({"key": "object/1", "token": "0"}, True, "non-zero"),
        ({"key": "object/1", "token": "1e3"}, True, "canonical uint64"),
        ({"key": "object/1", "token": "5.0"}, True, "canonical uint64"),
        ({"key": "object/1", "token": ""}, True, "canonical uint64"),
        ({"key": "object/1", "token": " 7"}, True, "canonical uint64"),
        ({"key": "object/1", "token": "+7"}, True, "canonical uint64"),
        ({"key": "object/1", "token": "-7"}, True, "canonical uint64"),
        ({"key": "object/1", "token": "\u0667"}, True, "canonical uint64"),  # ARABIC-INDIC DIGIT SEVEN
        ({"key": "object/1", "token": "18446744073709551616"}, True, "beyond uint64"),
        ({"key": "object/1", "token": "123456789012345678901"}, True, "canonical uint64"),
    ],
)
def test_protocol_errors_in_an_assignment_release_it_without_running(assignment, concurrency_keys, message):
    calls = []

    async def scenario():
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): lambda e: calls.append(1)}, concurrency_keys=concurrency_keys)
            server.assign("a1", **assignment)
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].release_reason)
            reason = server.attempts["a1"].release_reason
            assert reason.startswith("protocol error: ") and message in reason
            assert server.received("task.start") == []
            assert server.received("hello")[0]["concurrency_keys"] is concurrency_keys
            assert calls == []

    run(scenario)


def test_the_largest_token_is_accepted_as_an_int():
    tokens: dict[str, Any] = {}

    def handler(execution):
        tokens[execution.attempt_id] = execution.concurrency_token

    async def scenario():
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): handler}, capacity=2)
            server.assign("a1", key="k", token="18446744073709551615")
            server.assign("a2")
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].result and server.attempts["a2"].result)
            assert tokens == {"a1": 18446744073709551615, "a2": None}
            assert type(tokens["a1"]) is int

    run(scenario)


def slow_start(server: FakeServer, attempt_id: str) -> None:
    server.start_replies[attempt_id] = [{"type": "error", "code": "RATE_LIMITED", "retry_after_ms": 10_000}]


def test_a_repeated_assignment_that_changes_the_token_is_rejected():
    calls = []

    async def scenario():
        async with FakeServer() as server:
            slow_start(server, "a1")
            worker = make_worker(server, {("echo", "v1"): lambda e: calls.append(1)})
            server.assign("a1", key="object/1", token="7")
            async with running(worker):
                await server.wait_for(lambda: server.received("task.start", "a1"))
                server.assign("a1", key="object/1", token="8")
                await server.wait_for(lambda: server.attempts["a1"].release_reason)
            reason = server.attempts["a1"].release_reason
            assert reason.startswith("protocol error: ") and "concurrency_token changed from 7 to 8" in reason
            assert calls == [] and len(server.received("task.start")) == 1

    run(scenario)


def test_a_repeated_identical_assignment_is_only_acknowledged():
    calls = []

    async def scenario():
        async with FakeServer() as server:
            slow_start(server, "a1")
            server.start_replies["a1"][0]["retry_after_ms"] = 200
            worker = make_worker(server, {("echo", "v1"): lambda e: calls.append(1)})
            server.assign("a1", key="object/1", token="7")
            async with running(worker):
                await server.wait_for(lambda: server.received("task.start", "a1"))
                server.assign("a1", key="object/1", token="7")
                await server.wait_for(lambda: server.attempts["a1"].result is not None)
            assert calls == [1]
            # the first delivery is acknowledged by its Start, the repeat by an ack
            assert len(server.received("task.assign.ack", "a1")) == 1
            assert server.received("task.release") == []

    run(scenario)


@pytest.mark.parametrize(
    "change",
    [
        {"concurrency_token": "9"},
        {"task": {"concurrency_key": "object/2"}},
        {"concurrency_token": "nine"},
        {"epoch": 2},
    ],
)
def test_a_held_entry_that_changes_a_known_attempt_is_rejected(change):
    calls = []

    def tamper(held):
        for entry in held:
            for name, value in change.items():
                if name == "task":
                    entry["task"].update(value)
                else:
                    entry[name] = value
        return held

    async def scenario():
        async with FakeServer() as server:
            slow_start(server, "a1")
            worker = make_worker(server, {("echo", "v1"): lambda e: calls.append(1)})
            server.assign("a1", key="object/1", token="7")
            async with running(worker):
                await server.wait_for(lambda: server.received("task.start", "a1"))
                server.tamper_held = tamper
                await server.close_connection()
                await server.wait_for(lambda: server.attempts["a1"].release_reason)
            assert server.attempts["a1"].release_reason.startswith("protocol error: held entry: ")
            assert server.received("task.resume") == []
            assert calls == []

    run(scenario)


def test_a_resume_reply_that_changes_the_key_is_rejected():
    calls = []

    async def scenario():
        async with FakeServer() as server:
            slow_start(server, "a1")
            worker = make_worker(server, {("echo", "v1"): lambda e: calls.append(1)})
            frame = server.assign("a1", key="object/1", token="7")
            changed = {k: v for k, v in frame.items() if k not in ("type", "id")}
            changed = json.loads(json.dumps(changed))
            changed["task"]["concurrency_key"] = "object/other"
            server.resume_replies["a1"] = [{"type": "task.resume.ok", "assignment": {**changed, "state": "LEASED"}}]
            async with running(worker):
                await server.wait_for(lambda: server.received("task.start", "a1"))
                await server.close_connection()
                await server.wait_for(lambda: server.attempts["a1"].release_reason)
            reason = server.attempts["a1"].release_reason
            assert reason.startswith("protocol error: task.resume.ok: ") and "concurrency_key changed" in reason
            assert calls == []

    run(scenario)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("spec", "status"),
    [
        ({"code": "UNAUTHENTICATED", "message": "invalid bearer token", "close": 4401}, 401),
        ({"code": "STATE_CONFLICT", "message": "concurrency_keys changed", "close": 4409}, 409),
        ({"code": "PERMISSION_DENIED", "message": "no workers:consume"}, 403),
    ],
)
def test_a_refused_hello_ends_run_with_an_api_error(spec, status):
    async def scenario():
        async with FakeServer() as server:
            server.hello_error = spec
            worker = make_worker(server, {("echo", "v1"): lambda e: None})
            with pytest.raises(orbit_sdk.APIError) as caught:
                await asyncio.wait_for(worker.run_async(), 2.0)
            assert (caught.value.code, caught.value.status_code) == (spec["code"], status)
            assert server.connections == 1
            assert worker.join(0)

    run(scenario)


@pytest.mark.parametrize(
    ("token", "error", "message"),
    [
        (token, ValueError, "token must be a non-empty string of printable ASCII")
        for token in [TOKEN + "\n", " " + TOKEN, TOKEN.replace("_", " ", 1), "", "t\u00f6k"]
    ]
    + [(None, TypeError, "token must be a string, got NoneType")],
)
def test_a_token_the_authorization_header_cannot_carry_is_refused_like_the_clients(
    token: Any, error: type[Exception], message: str
):
    """A token read from a file or a Kubernetes secret (``open(path).read()``) ends with a
    newline. ``Worker(url, token, ...)`` refuses it when made, with the Client's own check and
    error (without quoting the token), rather than failing every connect for ever."""
    with pytest.raises(error, match=message) as refused:
        orbit_sdk.Worker("http://orbit.test", token, ["q1"], {"echo": lambda e: None})
    with pytest.raises(error) as client_refused:
        orbit_sdk.Client("http://orbit.test", token)
    assert str(refused.value) == str(client_refused.value)
    assert SECRET not in str(refused.value)


def test_a_handshake_that_cannot_carry_the_token_ends_the_run_and_no_log_line_quotes_it(caplog):
    """The worker never writes the bearer token into its logs, nor into what ends its run.
    Should websockets still refuse the Authorization header (its InvalidHeaderValue quotes the
    header, token included), that is no lost connection to retry: the run ends at once with a
    ValueError that names the token, not its value, and carries no websockets exception."""
    caplog.set_level(logging.DEBUG, logger="orbit_sdk.worker")

    async def scenario() -> tuple[ValueError, int]:
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): lambda e: None})
            worker._link._token = TOKEN + "\n"  # past the check Worker() makes
            with pytest.raises(ValueError, match="token") as ended:
                await asyncio.wait_for(worker.run_async(), 2.0)
            return ended.value, server.connections

    error, connections = run(scenario)
    assert connections == 0
    assert error.__cause__ is None and error.__context__ is None
    texts = [record.getMessage() for record in caplog.records] + [str(error), repr(error)]
    assert [text for text in texts if SECRET in text] == []


def test_websockets_debug_log_of_the_handshake_leaves_the_token_out(caplog):
    """At DEBUG, websockets logs the handshake's request headers (``websockets.client``, as
    usual); the worker's connections log the Authorization header without the token."""
    caplog.set_level(logging.DEBUG, logger="websockets.client")

    async def scenario() -> None:
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): lambda e: None})
            async with running(worker):
                await server.wait_for(lambda: server.received("hello"))
            assert server.auth_headers == [f"Bearer {TOKEN}"]  # what was sent is the token itself

    run(scenario)
    logged = [record.getMessage() for record in caplog.records if record.name == "websockets.client"]
    assert "> Authorization: Bearer [token]" in logged
    assert [text for text in logged if SECRET in text] == []


@contextlib.asynccontextmanager
async def answering_handshakes(answer_bytes: bytes) -> AsyncIterator[tuple[orbit_sdk.Worker, list[int]]]:
    """A server that answers every WebSocket handshake with `answer_bytes` and closes, and a
    worker of its URL that reconnects quickly; the count of handshakes answered (as `[n]`)."""
    answered = [0]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered[0] += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer_bytes)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield (
            orbit_sdk.Worker(
                f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}",
                TOKEN,
                ["q1"],
                {"echo": lambda e: None},
                min_reconnect_delay=0.02,
                max_reconnect_delay=0.05,
            ),
            answered,
        )


def test_a_handshake_answer_that_is_not_websocket_ends_the_run_with_a_protocol_error():
    """A server, or a proxy in front of it, that answers the handshake with an invalid Upgrade
    header will answer so every time: the run ends with a ProtocolError after one attempt,
    rather than reconnecting for ever as after a lost connection."""

    async def scenario() -> int:
        head = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n"
        async with answering_handshakes(head) as (worker, answered):
            with pytest.raises(orbit_sdk.ProtocolError, match="Upgrade header") as ended:
                await asyncio.wait_for(worker.run_async(), 2.0)
        assert SECRET not in str(ended.value)
        return answered[0]

    assert run(scenario) == 1


# A plain HTTP answer's headers and body, after its status line.
PAGE = b"\r\nContent-Type: text/html\r\nContent-Length: 5\r\n\r\nhello"


@pytest.mark.parametrize(
    "status_line", [b"HTTP/1.1 200 OK", b"HTTP/1.1 400 Bad Request", b"HTTP/1.1 426 Upgrade Required"]
)
def test_a_handshake_answered_by_a_plain_http_page_ends_the_run_with_a_protocol_error(status_line):
    """Another service at the URL (or a proxy that does not pass WebSocket on) answers
    every handshake the same way: the run ends after one, rather than retrying for ever."""

    async def scenario() -> int:
        status = status_line.split()[1].decode()
        async with answering_handshakes(status_line + PAGE) as (worker, answered):
            with pytest.raises(orbit_sdk.ProtocolError, match=f"HTTP {status}.*does not accept WebSocket") as ended:
                await asyncio.wait_for(worker.run_async(), 2.0)
        assert SECRET not in str(ended.value)
        return answered[0]

    assert run(scenario) == 1


@pytest.mark.parametrize("status_line", [b"HTTP/1.1 503 Service Unavailable", b"HTTP/1.1 429 Too Many Requests"])
def test_a_handshake_answered_unavailable_is_retried(status_line):
    """A server (or proxy) that is starting, overloaded or moving a cell answers for now."""

    async def scenario() -> int:
        async with answering_handshakes(status_line + PAGE) as (worker, answered):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(worker.run_async(), 0.5)
        return answered[0]

    assert run(scenario) >= 3


@pytest.mark.parametrize(
    "options",
    [
        {"min_reconnect_delay": 0},
        {"min_reconnect_delay": -1},
        {"max_reconnect_delay": 0},
        {"request_timeout": 0},
        {"request_timeout": -5},
        {"request_timeout": "15"},
        {"request_timeout": True},
        {"request_timeout": math.nan},
        {"max_reconnect_delay": math.inf},
        {"min_reconnect_delay": None},
        {"min_reconnect_delay": 5, "max_reconnect_delay": 1},
    ],
    ids=lambda options: ",".join(f"{name}={value!r}" for name, value in options.items()),
)
def test_timing_options_that_cannot_work_are_refused_naming_the_option(options: dict[str, Any]):
    """``request_timeout``, ``min_reconnect_delay`` and ``max_reconnect_delay`` are seconds:
    an int or a float, finite and above zero, the minimum delay at most the maximum. Anything
    else is a TypeError (not a number) or ValueError naming the option, when the worker is made:
    not a reconnect loop that never waits or never gets an answer in time, nor a TypeError
    from inside the event loop later."""
    name = next(iter(options))
    with pytest.raises((ValueError, TypeError), match=name):
        orbit_sdk.Worker("http://orbit.test", TOKEN, ["q1"], {"echo": lambda e: None}, **options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"concurrency_keys": "false"}, "concurrency_keys must be a bool, got str"),
        ({"concurrency_keys": 0}, "concurrency_keys must be a bool, got int"),
        ({"capacity": "2"}, "capacity must be an int between 1 and 1000, got str"),
        ({"capacity": 2.0}, "capacity must be an int between 1 and 1000, got float"),
    ],
    ids=repr,
)
def test_worker_options_of_the_wrong_kind_are_a_type_error(options: dict[str, Any], message: str):
    # (a string "false" is true: the worker would take keyed tasks, for good under its worker_id)
    with pytest.raises(TypeError, match=message):
        orbit_sdk.Worker("http://orbit.test", TOKEN, ["q1"], {"echo": lambda e: None}, **options)


def test_a_url_websockets_could_not_connect_to_is_refused_when_the_worker_is_made():
    with pytest.raises(ValueError, match="url"):
        orbit_sdk.Worker("http://user@orbit.test", TOKEN, ["q1"], {"echo": lambda e: None})


def test_stop_ends_run_while_disconnected():
    async def scenario():
        worker = orbit_sdk.Worker(
            "http://127.0.0.1:9", TOKEN, ["q1"], {"echo": lambda e: None}, min_reconnect_delay=0.02
        )
        task = asyncio.create_task(worker.run_async())
        await asyncio.sleep(0.1)
        assert not task.done()
        worker.stop()
        await asyncio.wait_for(task, 1.0)

    run(scenario)


def test_constructor_validates_its_arguments():
    handlers = {"echo": lambda e: None}
    with pytest.raises(ValueError):
        orbit_sdk.Worker("http://h", TOKEN, [], handlers)
    with pytest.raises(ValueError):
        orbit_sdk.Worker("http://h", TOKEN, ["q"], handlers, capacity=0)
    with pytest.raises(ValueError):
        orbit_sdk.Worker("http://h", TOKEN, ["q"], {})
    with pytest.raises(ValueError):
        orbit_sdk.Worker("http://h", TOKEN, ["q"], {("echo",): lambda e: None})
    with pytest.raises(ValueError):
        orbit_sdk.Worker("http://h", TOKEN, ["q"], handlers, worker_id="bad\nid")
    with pytest.raises(ValueError):
        orbit_sdk.Worker("http://h", TOKEN, ["q"], handlers, worker_id="has space")


def test_blocking_run_in_its_own_thread_ends_after_a_drain_from_a_handler():
    async def scenario():
        async with FakeServer() as server:

            def handler(execution):
                execution.worker.drain()
                return "done"

            worker = make_worker(server, {("echo", "v1"): handler})
            server.assign("a1")
            await asyncio.wait_for(asyncio.to_thread(worker.run), 2.0)
            assert worker.join(0)
            assert server.attempts["a1"].result["output"] == "done"
            with pytest.raises(RuntimeError, match="runs once"):
                await asyncio.to_thread(worker.run)

    run(scenario)


def test_queues_given_as_a_string_is_refused_not_split_into_characters():
    with pytest.raises(ValueError, match="queues must be a list of queue ids, not a string"):
        orbit_sdk.Worker("http://orbit", "orb_x", "0123456789abcdef0123456789abcdef", {"echo": print})


def test_a_secret_holding_an_underscore_is_redacted_whole():
    """orb_<id>_<secret>: URL-safe base64 puts "_" in about half of all secrets; the part
    after the last one alone was redacted, the rest of the secret left in the text."""
    token = f"orb_{'a' * 32}_head_of_the_secret_and_its_tail"
    worker = orbit_sdk.Worker("http://127.0.0.1:1", token, ["q"], {"h": lambda execution: None})
    said = worker._link.redact("refused: head_of_the_secret_and_its_tail")
    assert said == "refused: [secret]"

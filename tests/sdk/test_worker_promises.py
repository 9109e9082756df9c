"""What sdk/README.md promises a handler's outcome is, held against handlers that raise or
return the unusual: every one of them ends in a result the worker reports at once (never an
attempt left silently to its lease), and the worker goes on serving.

  | raises anything else       | FAILED, not retryable, error {"type": class name, "message": str(exc)} |
  | returns what is not JSON   | UNKNOWN with error type OutputNotSerializable (the effect happened)   |

Against a live server on MariaDB. Each case below once sent no result at all (the
task stayed RUNNING until its lease ran out, then NEEDS_REVIEW with LEASE_EXPIRED), and a
KeyboardInterrupt or SystemExit raised by one handler ended the whole worker, abandoning every
other attempt it held.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import orbit_sdk
from tests.support.fake_server import FakeServer
from tests.support.sdk_worker import make_worker, run, running


def nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def result_of(server: FakeServer, attempt_id: str) -> dict[str, Any]:
    frame = server.attempts[attempt_id].result
    assert frame is not None
    return {k: frame.get(k) for k in ("outcome", "retryable", "output", "error")}


def reported(handler: Any) -> dict[str, Any]:
    """The result a worker serving `handler` reports for one assignment."""

    async def scenario() -> dict[str, Any]:
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): handler})
            server.assign("a1")
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].result is not None)
            return result_of(server, "a1")

    return run(scenario)


async def stopped(worker: orbit_sdk.Worker) -> None:
    """Stop a start()ed worker and wait for it; what ended it fails the test (a KeyboardInterrupt
    re-raised by join() would otherwise end the whole test run)."""
    worker.stop(timeout=0)
    try:
        await asyncio.to_thread(worker.join, 3)
    except BaseException as exc:  # a test failure, whatever it was
        pytest.fail(f"the worker ended with {exc!r}")


BASE_EXCEPTIONS = [KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError]


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("exc_type", BASE_EXCEPTIONS, ids=lambda exc: exc.__name__)
def test_a_handler_raising_a_base_exception_is_reported_failed_and_the_worker_goes_on(kind, exc_type):
    # In a thread of its own (start()), as the quickstart embeds it: what escapes the worker's
    # loop then ends that thread, not the test run.
    def sync_handler(execution):
        if execution.payload["case"] == "bad":
            raise exc_type("raised by the handler")
        return {"ok": True}

    async def async_handler(execution):
        await asyncio.sleep(0)
        if execution.payload["case"] == "bad":
            raise exc_type("raised by the handler")
        return {"ok": True}

    async def scenario():
        async with FakeServer() as server:
            handler = sync_handler if kind == "sync" else async_handler
            worker = make_worker(server, {("echo", "v1"): handler}, capacity=2)
            server.assign("bad", payload={"case": "bad"})
            worker.start()
            try:
                await server.wait_for(lambda: server.attempts["bad"].result is not None, timeout=3)
                server.assign("after", payload={"case": "after"})
                await server.wait_for(lambda: server.attempts["after"].result is not None, timeout=3)
            finally:
                await stopped(worker)
            assert result_of(server, "bad") == {
                "outcome": "FAILED",
                "retryable": False,
                "output": None,
                "error": {"type": exc_type.__name__, "message": "raised by the handler"},
            }
            assert result_of(server, "after")["output"] == {"ok": True}

    run(scenario, timeout=10)


def test_a_hard_stop_still_sends_no_result_for_a_running_async_handler():
    # The fix above must not turn the worker's own cancellation (stop(timeout=0)) into a result.
    started = threading.Event()

    async def endless(execution):
        started.set()
        await asyncio.sleep(60)

    async def scenario():
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): endless})
            server.assign("a1")
            async with running(worker):
                await server.wait_for(started.is_set)
                worker.stop(timeout=0)
            await asyncio.sleep(0.1)
            assert server.attempts["a1"].result is None
            assert not server.received("task.result")

    run(scenario)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_output_nested_past_the_encoders_recursion_limit_is_reported_not_serializable(kind):
    def sync_handler(execution):
        return nested(5000)

    async def async_handler(execution):
        return nested(5000)

    result = reported(sync_handler if kind == "sync" else async_handler)
    assert result["outcome"] == "UNKNOWN"
    assert result["error"]["type"] == "OutputNotSerializable"


def test_an_exception_whose_str_raises_is_still_reported_failed():
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text for this one")

    def handler(execution):
        raise Unprintable()

    result = reported(handler)
    assert result["outcome"] == "FAILED"
    assert result["retryable"] is False
    assert result["error"]["type"] == "Unprintable"
    assert isinstance(result["error"]["message"], str)


def test_an_exception_message_with_a_lone_surrogate_is_sent_as_valid_utf8():
    # The real server refuses such a frame ("frame: must be valid UTF-8 (no lone surrogates)",
    # INVALID_ARGUMENT), a definite refusal the worker does not re-send: no result at all.
    def handler(execution):
        raise ValueError("bad \ud800 text")

    result = reported(handler)
    assert result["outcome"] == "FAILED"
    assert result["error"]["type"] == "ValueError"
    message = result["error"]["message"]
    message.encode("utf-8")  # no lone surrogate left
    assert message.startswith("bad ") and message.endswith(" text")


def test_a_worker_whose_handler_raised_systemexit_keeps_serving_for_minutes_not_just_once():
    # A sync handler's SystemExit, as sys.exit() in a thread, ends nothing but that call.
    calls: list[float] = []

    def handler(execution):
        calls.append(time.monotonic())
        raise SystemExit(3)

    async def scenario():
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): handler}, capacity=3)
            for n in range(3):
                server.assign(f"a{n}")
            worker.start()
            try:
                await server.wait_for(lambda: all(server.attempts[f"a{n}"].result for n in range(3)), timeout=3)
            finally:
                await stopped(worker)
            for n in range(3):
                assert result_of(server, f"a{n}")["error"] == {"type": "SystemExit", "message": "3"}

    run(scenario, timeout=10)

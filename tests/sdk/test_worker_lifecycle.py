"""Worker life cycle: graceful stop on SIGTERM/SIGINT, start()/stop()/join() for embedding,
hellos answered "not now", reconnect backoff, and closes for cause (1009, 4408) that are logged
and reconnected."""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

import orbit_sdk
from tests.support.fake_server import FakeServer
from tests.support.sdk_worker import TOKEN, make_worker, recv_types, run, running

# A worker process as a program runs one: Worker.run() on the main thread.
WORKER_PROGRAM = textwrap.dedent(
    """
    import asyncio, logging, sys, threading, time
    import orbit_sdk

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    printing = threading.Lock()  # handlers on threads: print() writes a line in parts

    def say(*words):
        with printing:
            print(*words, flush=True)

    def slow(execution):
        say("started", execution.attempt_id)
        time.sleep(0.5)
        return {"finished": execution.attempt_id}

    async def endless(execution):
        say("started", execution.attempt_id)
        await asyncio.sleep(60)

    handlers = {("echo", "v1"): slow, ("endless", "v1"): endless}
    worker = orbit_sdk.Worker(sys.argv[1], sys.argv[2], ["q1"], handlers, capacity=2, worker_id="w1",
                              request_timeout=2.0, min_reconnect_delay=0.05)
    worker.run()
    say("run returned")
    """
)


async def start_worker_process(server: FakeServer) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        WORKER_PROGRAM,
        server.url,
        TOKEN,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def read_line(process: asyncio.subprocess.Process, timeout: float = 5.0) -> str:
    assert process.stdout is not None
    return (await asyncio.wait_for(process.stdout.readline(), timeout)).decode().strip()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_drains_lets_the_running_handler_finish_and_report_then_run_returns(signum):
    async def scenario() -> None:
        async with FakeServer() as server:
            server.assign("a1")
            process = await start_worker_process(server)
            try:
                assert await read_line(process) == "started a1"
                process.send_signal(signum)
                await server.wait_for(lambda: server.received("drain"), timeout=5)
                # Offered after the drain: handed back, never run.
                server.assign("a2")
                returncode = await asyncio.wait_for(process.wait(), 10)
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            assert process.stdout is not None and process.stderr is not None
            rest = (await process.stdout.read()).decode().splitlines()
            log = (await process.stderr.read()).decode()
            assert returncode == 0, log
            assert rest == ["run returned"], log
            assert server.attempts["a1"].result is not None
            assert server.attempts["a1"].result["output"] == {"finished": "a1"}
            assert server.attempts["a2"].release_reason == "draining"
            assert server.attempts["a2"].result is None
            kinds = recv_types(server)
            assert kinds.index("drain") < kinds.index("task.result")
            assert f"{signal.Signals(signum).name}: stopping gracefully" in log

    run(scenario, timeout=20)


def test_a_second_signal_stops_at_once():
    async def scenario() -> None:
        async with FakeServer() as server:
            server.assign("a1", handler="endless")
            process = await start_worker_process(server)
            try:
                assert await read_line(process) == "started a1"
                process.send_signal(signal.SIGINT)
                await server.wait_for(lambda: server.received("drain"), timeout=5)
                started = time.monotonic()
                process.send_signal(signal.SIGINT)
                returncode = await asyncio.wait_for(process.wait(), 10)
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            assert process.stderr is not None
            log = (await process.stderr.read()).decode()
            assert returncode == 0, log
            assert time.monotonic() - started < 5
            assert server.attempts["a1"].result is None  # abandoned: its lease runs out on the server
            assert "SIGINT again: stopping now" in log

    run(scenario, timeout=20)


# --------------------------------------------------------------------------- embedding


def test_start_stop_join_embed_the_worker_in_a_background_thread():
    async def scenario() -> None:
        async with FakeServer() as server:

            def handler(execution: orbit_sdk.Execution) -> str:
                time.sleep(0.3)
                return "done"

            worker = make_worker(server, {("echo", "v1"): handler})
            server.assign("a1")
            worker.start()
            with pytest.raises(RuntimeError, match="runs once"):
                worker.start()
            await server.wait_for(lambda: server.received("task.start", "a1"))
            assert not worker.join(0)
            worker.stop()
            assert await asyncio.to_thread(worker.join, 3)
            assert server.attempts["a1"].result is not None
            assert server.attempts["a1"].result["output"] == "done"
            kinds = recv_types(server)
            assert kinds.index("drain") < kinds.index("task.result")

    run(scenario, timeout=5)


def test_join_raises_what_ended_a_started_worker():
    async def scenario() -> None:
        async with FakeServer() as server:
            server.hello_error = {"code": "UNAUTHENTICATED", "message": "invalid bearer token", "close": 4401}
            worker = make_worker(server, {("echo", "v1"): lambda e: None})
            worker.start()
            with pytest.raises(orbit_sdk.APIError) as caught:
                await asyncio.to_thread(worker.join, 3)
            assert caught.value.code == "UNAUTHENTICATED"

    run(scenario, timeout=5)


def test_stop_with_a_timeout_ends_work_that_does_not_finish_in_time():
    async def scenario() -> None:
        async with FakeServer() as server:

            async def endless(execution: orbit_sdk.Execution) -> None:
                await asyncio.sleep(60)

            worker = make_worker(server, {("echo", "v1"): endless})
            server.assign("a1")
            async with running(worker) as task:
                await server.wait_for(lambda: server.received("task.start", "a1"))
                started = time.monotonic()
                worker.stop(timeout=0.3)
                await asyncio.wait_for(task, 2)
                assert 0.25 < time.monotonic() - started < 1.5
            assert server.received("drain")
            assert server.attempts["a1"].result is None

    run(scenario, timeout=5)


@pytest.mark.parametrize("timeout", [None, 0])
def test_stop_before_run_returns_without_connecting(timeout):
    async def scenario() -> None:
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): lambda e: None})
            worker.stop(timeout=timeout)
            await asyncio.wait_for(worker.run_async(), 1)
            assert server.connections == 0

    run(scenario)


def test_stop_refuses_a_negative_timeout():
    worker = orbit_sdk.Worker("http://h", TOKEN, ["q"], {"echo": lambda e: None})
    with pytest.raises(ValueError):
        worker.stop(timeout=-1)


@pytest.mark.parametrize(("timeout", "error"), [("5", TypeError), (True, TypeError), (math.nan, ValueError)])
def test_stop_refuses_a_timeout_that_is_not_a_finite_number_naming_it(timeout: Any, error: type[Exception]):
    worker = orbit_sdk.Worker("http://h", TOKEN, ["q"], {"echo": lambda e: None})
    with pytest.raises(error, match="timeout"):
        worker.stop(timeout=timeout)


def test_join_of_a_worker_never_started_returns_true_at_once():
    """``stop(); join()`` in a ``finally`` whose ``start()`` never ran (an earlier step failed)
    returns at once: a worker never started has nothing to wait for, and join says it is over."""
    worker = orbit_sdk.Worker("http://orbit.test", TOKEN, ["q1"], {"echo": lambda e: None})
    worker.stop()
    joined: list[bool] = []
    thread = threading.Thread(target=lambda: joined.append(worker.join()), daemon=True)
    thread.start()
    thread.join(1.0)
    assert joined == [True], "join() of a worker that never ran is still blocking after 1 s"
    assert worker.join(0) is True


# --------------------------------------------------------------------------- reconnects


def refused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again: connecting to it is refused


def test_a_worker_whose_server_is_down_reconnects_with_a_growing_backoff(caplog):
    """README: a worker reconnects "with a growing backoff". A first delay that could not grow
    (``min_reconnect_delay=0``: twice 0 is 0) is refused when the worker is made, so a worker
    whose server refuses connections never reconnects in a tight loop: even from a 10 ms delay
    it tries a handful of times in its first second, fewer and fewer."""
    url = f"http://127.0.0.1:{refused_port()}"
    with pytest.raises(ValueError, match="min_reconnect_delay"):
        orbit_sdk.Worker(url, TOKEN, ["q1"], {"echo": lambda e: None}, min_reconnect_delay=0)
    caplog.set_level(logging.WARNING, logger="orbit_sdk.worker")
    worker = orbit_sdk.Worker(url, TOKEN, ["q1"], {"echo": lambda e: None}, min_reconnect_delay=0.01)
    worker.start()
    time.sleep(1.0)
    worker.stop(timeout=0)
    assert worker.join(5)
    attempts = sum("connection lost" in record.getMessage() for record in caplog.records)
    assert 3 <= attempts <= 10, f"{attempts} connection attempts in one second against a refused port"


def test_a_hello_answered_unavailable_is_retried_with_growing_backoff(caplog):
    message = "worker_id is in use by a live connection consuming queues outside this credential's range; retry"

    async def scenario() -> None:
        async with FakeServer() as server:
            server.hello_refusals = [{"code": "UNAVAILABLE", "message": message}] * 3
            worker = make_worker(
                server, {("echo", "v1"): lambda e: "ok"}, min_reconnect_delay=0.05, max_reconnect_delay=1.0
            )
            server.assign("a1")
            async with running(worker):
                await server.wait_for(lambda: server.attempts["a1"].result is not None, timeout=3)
            assert server.connections == 4
            gaps = [b - a for a, b in zip(server.connected_at, server.connected_at[1:], strict=False)]
            assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.2, gaps

    with caplog.at_level(logging.WARNING, logger="orbit_sdk.worker"):
        run(scenario)
    refusals = [r.getMessage() for r in caplog.records if "hello answered UNAVAILABLE" in r.getMessage()]
    assert len(refusals) == 3 and all(message in text for text in refusals)


@pytest.mark.parametrize(
    ("spec", "status"),
    [
        ({"code": "INVALID_ARGUMENT", "message": "capacity: must be 1 to 1000"}, 400),
        ({"code": "NOT_FOUND", "message": "queue not found: q1"}, 404),
    ],
)
def test_other_hello_refusals_stay_fatal(spec, status):
    async def scenario() -> None:
        async with FakeServer() as server:
            server.hello_refusals = [spec]
            worker = make_worker(server, {("echo", "v1"): lambda e: None})
            with pytest.raises(orbit_sdk.APIError) as caught:
                await asyncio.wait_for(worker.run_async(), 2.0)
            assert (caught.value.code, caught.value.status_code) == (spec["code"], status)
            assert server.connections == 1

    run(scenario)


@pytest.mark.parametrize(
    ("close_code", "code", "message", "level"),
    [
        (4408, "ACK_TIMEOUT", "1 assignments not acknowledged within 10 s; their leases were released", "WARNING"),
        (1009, "INVALID_ARGUMENT", "frame: over the 1048576 byte message limit", "ERROR"),
    ],
)
def test_a_close_for_cause_is_logged_with_the_servers_message_then_reconnected(
    caplog, close_code, code, message, level
):
    async def scenario() -> None:
        async with FakeServer() as server:
            go = asyncio.Event()

            async def handler(execution: orbit_sdk.Execution) -> str:
                await go.wait()
                return "after reconnect"

            worker = make_worker(server, {("echo", "v1"): handler})
            server.assign("a1")
            async with running(worker):
                await server.wait_for(lambda: server.received("task.start", "a1"))
                await server.close_with_error(close_code, code, message)
                await server.wait_for(lambda: len(server.received("hello")) == 2)
                go.set()
                await server.wait_for(lambda: server.attempts["a1"].result is not None)
            assert server.attempts["a1"].result["output"] == "after reconnect"
            assert server.received("task.resume", "a1")

    with caplog.at_level(logging.WARNING, logger="orbit_sdk.worker"):
        run(scenario)
    closes = [r for r in caplog.records if "connection closed by the server" in r.getMessage()]
    assert len(closes) == 1
    text: Any = closes[0].getMessage()
    assert f"code {close_code}" in text and code in text and message in text and "reconnecting" in text
    assert closes[0].levelname == level


def test_a_close_after_an_unrelated_earlier_error_does_not_quote_it(caplog):
    async def scenario() -> None:
        async with FakeServer() as server:
            worker = make_worker(server, {("echo", "v1"): lambda e: "ok"})
            async with running(worker):
                await server.wait_for(lambda: server.received("hello"))
                await server._send(server._live, {"type": "error", "code": "INVALID_ARGUMENT", "message": "old"})
                server.assign("a1")
                await server.wait_for(lambda: server.attempts["a1"].result is not None)
                await server.close_connection(1011)
                await server.wait_for(lambda: len(server.received("hello")) == 2)

    with caplog.at_level(logging.WARNING, logger="orbit_sdk.worker"):
        run(scenario)
    (close,) = [r.getMessage() for r in caplog.records if "connection closed by the server" in r.getMessage()]
    assert "code 1011" in close and "old" not in close

"""Stopping a worker at once while a sync handler is still running (issue 37, item 3).

As a user sees it: a program runs ``Worker.run()`` with a plain function handler that sleeps
30 s. A second SIGTERM, or ``stop(timeout=0)`` from another thread, ends ``run()`` within
seconds; the handler's thread is abandoned (a daemon: the process may exit under it) and its
attempt is left to its lease: no result, no release is sent for it.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
import threading
import time

import orbit_sdk
from tests.support.fake_server import FakeServer
from tests.support.sdk_worker import TOKEN, make_worker, recv_types, run, running

# argv: url, token, mode ("signals" or "stop0"), handler seconds, seconds to live on after run().
WORKER_PROGRAM = textwrap.dedent(
    """
    import logging, sys, threading, time
    import orbit_sdk

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    printing = threading.Lock()  # handlers on threads: print() writes a line in parts

    def say(*words):
        with printing:
            print(*words, flush=True)

    url, token, mode, seconds, linger = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
    running = threading.Event()

    def slow(execution):
        say("started", execution.attempt_id)
        running.set()
        time.sleep(seconds)
        say("handler finished", execution.attempt_id)
        return {"finished": execution.attempt_id}

    worker = orbit_sdk.Worker(url, token, ["q1"], {("echo", "v1"): slow}, worker_id="w1",
                              request_timeout=2.0, min_reconnect_delay=0.05)
    if mode == "stop0":
        def stop_when_running():
            running.wait()
            time.sleep(0.2)
            say("stopping")
            worker.stop(timeout=0)

        threading.Thread(target=stop_when_running, daemon=True).start()
    worker.run()
    say("run returned")
    time.sleep(linger)  # an embedding program that goes on after run(): the abandoned thread may finish
    """
)


async def start_worker_process(
    server: FakeServer, mode: str, handler_seconds: float, linger: float = 0.0
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        WORKER_PROGRAM,
        server.url,
        TOKEN,
        mode,
        str(handler_seconds),
        str(linger),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def read_line(process: asyncio.subprocess.Process, timeout: float = 5.0) -> str:
    assert process.stdout is not None
    return (await asyncio.wait_for(process.stdout.readline(), timeout)).decode().strip()


async def finish(process: asyncio.subprocess.Process, timeout: float) -> tuple[int, list[str], str]:
    """Wait up to `timeout` for the process to exit (killed otherwise); returns code, stdout lines, stderr."""
    try:
        returncode = await asyncio.wait_for(process.wait(), timeout)
    except TimeoutError:
        returncode = None
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.stdout is not None and process.stderr is not None
    rest = (await process.stdout.read()).decode().splitlines()
    log = (await process.stderr.read()).decode()
    assert returncode is not None, f"still running after {timeout} s; stderr:\n{log}"
    return returncode, rest, log


def assert_left_to_its_lease(server: FakeServer, attempt_id: str) -> None:
    attempt = server.attempts[attempt_id]
    assert attempt.state == "RUNNING"  # as the server last heard: its lease decides what happens next
    assert attempt.result is None and attempt.results_received == 0
    assert attempt.release_reason is None
    assert not server.received("task.result", attempt_id) and not server.received("task.release", attempt_id)


def test_a_second_sigterm_ends_run_within_5_s_while_a_30_s_sync_handler_runs() -> None:
    async def scenario() -> None:
        async with FakeServer() as server:
            server.assign("a1")
            process = await start_worker_process(server, "signals", handler_seconds=30)
            try:
                assert await read_line(process) == "started a1"
                process.send_signal(signal.SIGTERM)
                await server.wait_for(lambda: server.received("drain"), timeout=5)
                await asyncio.sleep(0.5)
                assert process.returncode is None  # the first signal drains: the handler goes on
                started = time.monotonic()
                process.send_signal(signal.SIGTERM)
                returncode, rest, log = await finish(process, timeout=10)
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            assert time.monotonic() - started < 5, log
            assert returncode == 0, log
            assert rest == ["run returned"], log
            assert "SIGTERM: stopping gracefully" in log
            assert "SIGTERM again: stopping now" in log
            assert "Traceback" not in log, log
            assert_left_to_its_lease(server, "a1")

    run(scenario, timeout=30)


def test_stop_timeout_0_from_another_thread_ends_run_within_5_s_while_a_30_s_sync_handler_runs() -> None:
    async def scenario() -> None:
        async with FakeServer() as server:
            server.assign("a1")
            process = await start_worker_process(server, "stop0", handler_seconds=30)
            try:
                assert await read_line(process) == "started a1"
                assert await read_line(process) == "stopping"
                started = time.monotonic()
                returncode, rest, log = await finish(process, timeout=10)
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            assert time.monotonic() - started < 5, log
            assert returncode == 0, log
            assert rest == ["run returned"], log
            assert "Traceback" not in log, log
            assert_left_to_its_lease(server, "a1")

    run(scenario, timeout=30)


def test_an_abandoned_sync_handler_that_finishes_later_reports_nothing() -> None:
    """The program lives on after run(): the abandoned thread returns, quietly, and its result is dropped."""

    async def scenario() -> None:
        async with FakeServer() as server:
            server.assign("a1")
            process = await start_worker_process(server, "stop0", handler_seconds=1.5, linger=2.5)
            try:
                assert await read_line(process) == "started a1"
                assert await read_line(process) == "stopping"
                assert await read_line(process, timeout=1.0) == "run returned"  # before the handler's 1.5 s
                returncode, rest, log = await finish(process, timeout=10)
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            assert returncode == 0, log
            assert rest == ["handler finished a1"], log
            assert "Traceback" not in log and "Exception" not in log, log
            assert_left_to_its_lease(server, "a1")
            assert server.connections == 1
            assert "drain" not in recv_types(server)  # stop(timeout=0) ends at once, it does not drain

    run(scenario, timeout=30)


def test_stop_with_a_timeout_abandons_a_sync_handler_still_running_when_it_runs_out() -> None:
    """The graceful part waits (drain first); once the timeout passes, run ends without the thread."""

    async def scenario() -> None:
        async with FakeServer() as server:
            release = threading.Event()

            def blocked(execution: orbit_sdk.Execution) -> str:
                release.wait(30)
                return "late"

            worker = make_worker(server, {("echo", "v1"): blocked})
            server.assign("a1")
            try:
                async with running(worker) as task:
                    await server.wait_for(lambda: server.received("task.start", "a1"))
                    started = time.monotonic()
                    worker.stop(timeout=0.5)
                    await asyncio.sleep(0.3)
                    assert not task.done()  # still within the timeout: waiting for the handler
                    await asyncio.wait_for(task, 2)
                    assert 0.45 < time.monotonic() - started < 1.5
            finally:
                release.set()
            await asyncio.sleep(0.1)  # the thread returns after the stop: its value is dropped
            assert server.received("drain")
            assert_left_to_its_lease(server, "a1")

    run(scenario, timeout=5)

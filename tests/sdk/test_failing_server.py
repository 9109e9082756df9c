"""The SDK against a real server process that is killed, restarted on the same port,
or frozen (SIGSTOP): the client's typed errors and idempotent re-sends, and the worker's
reconnect, resume and stop. Each test starts its own server (they kill it)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import orbit_sdk
from orbit_sdk import Client, Execution, SubmitTaskRequest
from tests.support.live import ROOT, LiveServer, free_port, server_env
from tests.support.sdk_live import finished, new_queue, worker_for

pytestmark = pytest.mark.django_db(transaction=True)


class Server(LiveServer):
    """A live server of its own, killed, frozen (SIGSTOP) and started again on its port."""

    def kill(self) -> None:
        self.process.send_signal(signal.SIGCONT)
        self.process.kill()
        self.process.wait(10)

    def freeze(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self, kill: bool = True) -> None:
        if self.process.poll() is None:
            self.thaw()
        super().stop(kill)


@pytest.fixture
def server(django_db_blocker: Any) -> Iterator[Server]:
    (ROOT / ".local").mkdir(exist_ok=True)
    with django_db_blocker.unblock():
        env = server_env()
    served = Server(env)
    yield served
    served.stop()


def request_for(queue_id: str, handler: str = "h", **fields: Any) -> SubmitTaskRequest:
    return SubmitTaskRequest(queue_id, handler, "v1", "v1", {}, **fields)


# ------------------------------------------------------------------ the client


def test_connection_refused_is_a_transport_error() -> None:
    with Client(f"http://127.0.0.1:{free_port()}", "orb_x_y", timeout=2) as client:
        with pytest.raises(orbit_sdk.TransportError, match="ConnectError"):
            client.get_task("t")


def test_a_kept_alive_connection_survives_a_server_restart(server: Server, tenant: Any) -> None:
    with Client(server.url, tenant.token, timeout=5) as client:
        queue_id = new_queue(client).id
        client.get_queue(queue_id)  # a kept-alive connection now idles in the pool
        server.kill()
        server.start()
        # the first call after the restart must not fail on the dead pooled socket
        assert client.get_queue(queue_id).id == queue_id


def test_a_frozen_server_times_out_and_the_same_key_never_makes_a_second_task(server: Server, tenant: Any) -> None:
    with Client(server.url, tenant.token, timeout=1.5) as client:
        queue_id = new_queue(client).id
        request = request_for(queue_id)
        server.freeze()
        try:
            with pytest.raises(orbit_sdk.TransportError, match="timed out"):
                client.submit_task("frozen-submit", request)
            with pytest.raises(orbit_sdk.TransportError):
                client.submit_task("frozen-submit", request)
        finally:
            server.thaw()
        # As the README's submit() loop does: the same key again until there is an answer.
        answers = []
        for _ in range(20):
            try:
                answers.append(client.submit_task("frozen-submit", request))
                break
            except orbit_sdk.TransportError:
                time.sleep(0.5)
        assert answers, "no answer after the thaw"
        tasks = client.list_tasks(queue_id=queue_id).items
        assert len(tasks) == 1 and tasks[0].id == answers[0].task.id


def test_a_server_killed_mid_request_is_a_transport_error_and_the_resend_is_safe(server: Server, tenant: Any) -> None:
    with Client(server.url, tenant.token, timeout=None) as client:
        queue_id = new_queue(client).id
        request = request_for(queue_id)
        server.freeze()
        errors: list[BaseException] = []

        def call() -> None:
            try:
                client.submit_task("killed-submit", request)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.5)  # the request sits in the frozen server's socket
        server.kill()
        thread.join(10)
        assert not thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], orbit_sdk.TransportError), errors
        server.start()
        first = client.submit_task("killed-submit", request)
        again = client.submit_task("killed-submit", request)
        assert again.deduplicated and again.task.id == first.task.id
        assert len(client.list_tasks(queue_id=queue_id).items) == 1


# ------------------------------------------------------------------ the worker


def test_a_running_handler_survives_a_server_kill_and_restart(server: Server, tenant: Any) -> None:
    with Client(server.url, tenant.token, timeout=5) as client:
        queue_id = new_queue(client).id
        running = threading.Event()
        runs: list[str] = []

        def slow(execution: Execution) -> dict[str, int]:
            runs.append(execution.attempt_id)
            running.set()
            time.sleep(4)
            return {"n": 1}

        worker = worker_for(server.url, tenant, queue_id, {("h", "v1"): slow}, request_timeout=3)
        worker.start()
        try:
            task = client.submit_task("survive", request_for(queue_id)).task
            assert running.wait(15)
            server.kill()
            time.sleep(1)
            server.start()
            ended = finished(client, task.id, timeout=30)
            assert ended.state == "SUCCEEDED" and ended.attempts == 1 and ended.output == {"n": 1}
            assert len(runs) == 1
        finally:
            worker.stop()
            assert worker.join(20)


def test_a_running_handler_survives_a_frozen_server(server: Server, tenant: Any) -> None:
    with Client(server.url, tenant.token, timeout=5) as client:
        queue_id = new_queue(client).id
        running = threading.Event()

        def slow(execution: Execution) -> dict[str, int]:
            running.set()
            time.sleep(2)
            return {"n": 2}

        worker = worker_for(server.url, tenant, queue_id, {("h", "v1"): slow}, request_timeout=2)
        worker.start()
        try:
            task = client.submit_task("frozen-worker", request_for(queue_id)).task
            assert running.wait(15)
            server.freeze()
            time.sleep(6)  # the result is sent and re-sent into the frozen server
            server.thaw()
            ended = finished(client, task.id, timeout=30)
            assert ended.state == "SUCCEEDED" and ended.attempts == 1 and ended.output == {"n": 2}
        finally:
            server.thaw()
            worker.stop()
            assert worker.join(20)


def test_stop_at_once_while_the_server_is_frozen_ends_at_once(server: Server, tenant: Any) -> None:
    """README: `stop(timeout=0)` ends at once."""
    with Client(server.url, tenant.token, timeout=5) as client:
        queue_id = new_queue(client).id
    worker = worker_for(server.url, tenant, queue_id, {("h", "v1"): lambda execution: None})
    server.freeze()
    try:
        worker.start()
        time.sleep(1)  # connecting: the TCP connect succeeds, the handshake hangs
        began = time.monotonic()
        worker.stop(timeout=0)
        ended = worker.join(20)
        took = time.monotonic() - began
    finally:
        server.thaw()
    assert ended, "stop(timeout=0) did not end the worker within 20 s"
    assert took < 2, f"stop(timeout=0) took {took:.1f} s to end the worker"

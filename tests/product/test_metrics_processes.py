"""/metrics under `orbit serve --processes 2`: the counters add up across the
server processes, so every scrape, whichever child answers it, says the same."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.live import LIVE_METRICS_TOKEN, server_env
from tests.support.serve_processes import Served, alive, children
from tests.support.tasks import numbered_task, wait_until

pytestmark = [
    pytest.mark.django_db(transaction=True),  # the tenant must be visible to the server processes
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc"),
]

SUBMITS = 30
SUBMITTED = re.compile(r"^orbit_tasks_submitted_total (\S+)$", re.MULTILINE)
ANSWERED_BY = re.compile(r'^orbit_server_process\{pid="(\d+)"\} 1\.0$', re.MULTILINE)


@pytest.fixture
def served(django_db_blocker: Any, tmp_path: Path):
    with django_db_blocker.unblock():
        env = server_env()
    env.pop("ORBIT_HTTP_ADDR", None)
    made = Served({**env, "ORBIT_SECRET_KEY": "a-production-secret-for-the-tests"}, tmp_path, processes=2)
    try:
        yield made
    finally:
        if made.process.poll() is None:
            for child in children(made.process.pid):
                os.kill(child, signal.SIGKILL)
            made.process.kill()
            made.process.wait()


def submit_from_many_connections(served: Served, token: str, count: int) -> None:
    """Over ten connections held open at once, so that both children accept some."""
    base = f"http://127.0.0.1:{served.port}"
    clients = [httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30) for _ in range(10)]
    try:
        queue = clients[0].post(
            "/v1/queues",
            json={"name": "scraped", "max_concurrency": 1, "rate_per_second": 1},
            headers={"Idempotency-Key": "scraped"},
        )
        assert queue.status_code == 201, queue.text
        queue_id = queue.json()["data"]["queue"]["id"]
        for n in range(count):
            response = clients[n % len(clients)].post(
                "/v1/tasks", json=numbered_task(queue_id, n), headers={"Idempotency-Key": f"s{n}"}
            )
            assert response.status_code == 201, response.text
    finally:
        for client in clients:
            client.close()


def scrape(served: Served) -> tuple[float, str]:
    """One scrape on a connection of its own (the kernel picks the child):
    orbit_tasks_submitted_total and the pid that answered."""
    response = httpx.get(
        f"http://127.0.0.1:{served.port}/metrics",
        headers={"Authorization": f"Bearer {LIVE_METRICS_TOKEN}", "Connection": "close"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    (submitted,) = SUBMITTED.findall(response.text)
    (pid,) = ANSWERED_BY.findall(response.text)
    return float(submitted), pid


def scrapes_from_both_children(served: Served) -> list[tuple[float, str]]:
    """At least six scrapes, and more until both children have answered one."""
    kids = {str(pid) for pid in children(served.process.pid)}
    answers: list[tuple[float, str]] = []
    while len(answers) < 6 or {pid for _, pid in answers} != kids:
        assert len(answers) < 200, answers
        answers.append(scrape(served))
    return answers


def test_six_scrapes_with_two_processes_all_equal_the_submits(served: Served, tenant: Any) -> None:
    submit_from_many_connections(served, tenant.token, SUBMITS)

    answers = scrapes_from_both_children(served)

    assert [submitted for submitted, _ in answers] == [SUBMITS] * len(answers), answers


def test_a_restarted_child_keeps_what_it_counted_in_the_sum(served: Served, tenant: Any) -> None:
    submit_from_many_connections(served, tenant.token, SUBMITS)
    victim = children(served.process.pid)[0]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: not alive(victim), 5, "the killed child gone")
    wait_until(lambda: "serving again" in served.stderr.read_text(), 20, "the new child serving")

    answers = scrapes_from_both_children(served)

    assert [submitted for submitted, _ in answers] == [SUBMITS] * len(answers), answers
    assert str(victim) not in {pid for _, pid in answers}


def test_the_counters_directory_is_fresh_per_start_and_goes_at_stop(served: Served) -> None:
    kids = children(served.process.pid)
    directories = set()
    for pid in kids:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        directories |= {
            entry.split(b"=", 1)[1].decode() for entry in environ if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR=")
        }
    assert len(directories) == 1, directories  # one directory for all of them
    (directory,) = directories
    # Fresh: the files in it are these children's (counter_<pid>.db), none of another run's.
    written = {path.stem.rsplit("_", 1)[1] for path in Path(directory).iterdir()}
    assert written and written <= {str(pid) for pid in kids}, written
    assert served.stop() == 0, served.stderr.read_text()
    assert not Path(directory).exists()

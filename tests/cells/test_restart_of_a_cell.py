"""A cell's database restarted under a serving node: the node's pooled connections to it
all died with it, and one call finding that is enough for the others to reconnect."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.support.cells import MARKS, Installation

pytestmark = MARKS

CALLS = 32  # several times the server's 8 database threads a cell, at once


def test_after_a_restart_one_failed_call_is_enough_for_every_connection(installation: Installation) -> None:
    credential = installation.bootstrap("restarted", "b")
    assert installation.submit("restarted", "restarted-before").status_code == 201
    assert installation.server is not None
    url = f"{installation.server.url}/v1/queues/{credential['queue_id']}"
    headers = {"Authorization": f"Bearer {credential['token']}"}

    def reads() -> list[int]:
        with ThreadPoolExecutor(CALLS) as pool:
            return list(pool.map(lambda _: httpx.get(url, headers=headers, timeout=30).status_code, range(CALLS)))

    # given every database thread of the node holding a connection to cell b
    assert reads() == [200] * CALLS
    installation.private.stop(kill=True)
    installation.private.start()
    # when a first call finds its connection gone (it may answer 503: retry later)
    deadline = time.monotonic() + 30
    while installation.submit("restarted", "restarted-after").status_code != 201:
        assert time.monotonic() < deadline, "not served after its cell restarted"
        time.sleep(0.5)
    # then the other threads' connections from before the restart are not found gone one call at a time
    assert reads() == [200] * CALLS

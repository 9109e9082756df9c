"""Wake-ups between the processes of one supervisor (tasks.wakeups): real
datagram sockets in a directory, as the supervisor's children use them, and
the round's collected wake-ups."""

from __future__ import annotations

import os
import queue
import socket
import time
from pathlib import Path

import pytest

from tasks import wakeups
from tasks.wakeups import _Siblings


def listening(directory: Path, name: str) -> tuple[_Siblings, queue.Queue[list[str]]]:
    arrived: queue.Queue[list[str]] = queue.Queue()
    sibling = _Siblings(str(directory), name)
    sibling.listen(arrived.put)
    return sibling, arrived


def test_a_wake_up_reaches_every_other_sibling_and_not_the_sender(tmp_path: Path):
    first, first_got = listening(tmp_path, "1.sock")
    _, second_got = listening(tmp_path, "2.sock")
    _, third_got = listening(tmp_path, "3.sock")
    first.send(["queue-a", "queue-b"])
    assert second_got.get(timeout=5) == ["queue-a", "queue-b"]
    assert third_got.get(timeout=5) == ["queue-a", "queue-b"]
    with pytest.raises(queue.Empty):
        first_got.get(timeout=0.2)


def test_a_gone_sibling_is_skipped_and_its_socket_removed(tmp_path: Path):
    sender = _Siblings(str(tmp_path), "1.sock")
    _, live_got = listening(tmp_path, "2.sock")
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    gone.bind(str(tmp_path / "3.sock"))
    gone.close()  # its process died: the name stays, nobody reads it
    sender.send(["queue-a"])
    assert live_got.get(timeout=5) == ["queue-a"]
    deadline = time.monotonic() + 5
    while sorted(os.listdir(tmp_path)) != ["2.sock"]:
        assert time.monotonic() < deadline, os.listdir(tmp_path)
        time.sleep(0.01)


def test_without_a_directory_nothing_is_bound_or_sent(tmp_path: Path):
    alone = _Siblings(None)
    alone.listen(lambda queue_ids: None)
    alone.send(["queue-a"])  # no supervisor: nothing to send to, no error
    assert alone.directory is None


def test_a_sibling_started_later_is_found(tmp_path: Path):
    sender = _Siblings(str(tmp_path), "1.sock")
    sender._send_now(["before"])  # reads the (empty) listing
    sender._peers_read_at -= wakeups.SIBLINGS_REFRESH_SECONDS  # the listing is old now
    _, later_got = listening(tmp_path, "2.sock")
    sender._send_now(["after"])
    assert later_got.get(timeout=5) == ["after"]


def test_a_burst_of_wake_ups_arrives_as_few_datagrams_naming_every_queue(tmp_path: Path):
    sender = _Siblings(str(tmp_path), "1.sock")
    _, got = listening(tmp_path, "2.sock")
    for n in range(200):
        sender.send([f"queue-{n % 7}"])
    arrived: set[str] = set()
    datagrams = 0
    while arrived != {f"queue-{n}" for n in range(7)}:
        arrived.update(got.get(timeout=5))
        datagrams += 1
    assert datagrams < 200


def test_collected_wake_ups_are_the_collectors_to_send():
    with wakeups.collected() as woken:
        wakeups.wake_after_commit(["queue-a"])
        with wakeups.collected() as inner:  # an inner block collects into the outer one
            wakeups.wake_after_commit(["queue-b"])
        assert inner is woken
    assert woken == {"queue-a", "queue-b"}

"""Resource ids: random version 4 UUIDs in hex, read from the system's source in blocks."""

from __future__ import annotations

import os
import threading
import uuid
from unittest import mock

from orbit import fields
from orbit.fields import new_id


def test_an_id_is_a_random_uuid_in_lowercase_hex() -> None:
    for _ in range(1_000):
        resource_id = new_id()
        parsed = uuid.UUID(resource_id)
        assert parsed.hex == resource_id
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122


def test_the_random_source_is_read_once_per_256_ids() -> None:
    fields._forget_id_pool()
    with mock.patch.object(fields.os, "urandom", wraps=os.urandom) as urandom:
        ids = {new_id() for _ in range(512)}
    assert len(ids) == 512
    assert [call.args for call in urandom.call_args_list] == [(fields.ID_POOL_BYTES,)] * 2


def test_threads_never_share_an_id() -> None:
    made: list[list[str]] = [[] for _ in range(8)]
    start = threading.Barrier(len(made))

    def make(into: list[str]) -> None:
        start.wait()
        into.extend(new_id() for _ in range(2_000))

    threads = [threading.Thread(target=make, args=(into,)) for into in made]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every_id = [resource_id for into in made for resource_id in into]
    assert len(set(every_id)) == len(every_id) == 16_000


def test_a_forked_child_does_not_repeat_its_parents_next_id() -> None:
    new_id()  # the pool holds ids the parent has not handed out yet
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.write(write_end, new_id().encode("ascii"))
        os._exit(0)
    os.close(write_end)
    childs_id = os.read(read_end, 64).decode("ascii")
    os.close(read_end)
    os.waitpid(child, 0)
    assert len(childs_id) == 32
    assert childs_id != new_id()

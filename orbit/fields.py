"""Model field types shared by every app."""

from __future__ import annotations

import os
import re
import threading
from typing import Any

from django.db import models

# NO PAD binary collations: plain utf8mb4_bin is PAD SPACE, so "key" and
# "key " would compare equal. MariaDB and MySQL 8 spell it differently.
MARIADB_BINARY_COLLATION = "utf8mb4_nopad_bin"
MYSQL_BINARY_COLLATION = "utf8mb4_0900_bin"
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


# Random bytes are read 256 ids at a time: os.urandom releases the GIL, and
# the event loop thread that makes every request id then waits to get it back
# from a database thread busy in Python (~0.4 ms a call against one spinning
# thread, measured), stalling every connection the loop serves.
ID_POOL_BYTES = 4096


class _IdPool(threading.local):
    random_bytes: bytes = b""
    offset: int = 0


_id_pool = _IdPool()


def _forget_id_pool() -> None:
    # A forked child must not hand out the ids its parent still holds.
    _id_pool.random_bytes = b""
    _id_pool.offset = 0


os.register_at_fork(after_in_child=_forget_id_pool)


RESOURCE_ID = re.compile(r"[0-9a-f]{32}")


def is_resource_id(text: str) -> bool:
    """Whether `text` has the id format new_id makes. Checked before a lookup,
    so an id that cannot exist ("<id> ", upper case, 300 characters) is
    NOT_FOUND whatever the column's collation does."""
    return RESOURCE_ID.fullmatch(text) is not None


def new_id() -> str:
    """32 lowercase hex characters, the id format of every Orbit resource: a
    random (version 4) UUID, as uuid.uuid4().hex spells it."""
    pool = _id_pool
    offset = pool.offset
    if offset + 16 > len(pool.random_bytes):
        pool.random_bytes = os.urandom(ID_POOL_BYTES)
        offset = 0
    pool.offset = offset + 16
    raw = bytearray(pool.random_bytes[offset : offset + 16])
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # RFC 4122 variant
    return raw.hex()


class BinaryCharField(models.CharField):
    """A CharField that compares byte-for-byte on every backend.

    MySQL's default collations fold case and accents, and its `_bin` ones pad
    trailing spaces; the seeds forbid both for names and keys. SQLite's default
    BINARY collation is already exact and would reject the MySQL collation
    name, so the collation is chosen per vendor.
    """

    def db_parameters(self, connection: Any) -> dict[str, Any]:
        params = super().db_parameters(connection)
        if connection.vendor == "mysql":
            params["collation"] = MARIADB_BINARY_COLLATION if connection.mysql_is_mariadb else MYSQL_BINARY_COLLATION
        return params


class IdField(BinaryCharField):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", 32)
        super().__init__(*args, **kwargs)


def id_primary_key(comment: str) -> IdField:
    return IdField(primary_key=True, default=new_id, editable=False, db_comment=comment)


def uint64(comment: str, **kwargs: Any) -> models.PositiveBigIntegerField:
    """BIGINT UNSIGNED on MySQL; travels in JSON as a decimal string."""
    return models.PositiveBigIntegerField(db_comment=comment, **kwargs)


def uint32(comment: str, **kwargs: Any) -> models.PositiveIntegerField:
    return models.PositiveIntegerField(db_comment=comment, **kwargs)

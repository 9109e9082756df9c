"""How deep a JSON value may nest: one rule for HTTP bodies and worker frames."""

from __future__ import annotations

from typing import Any

# MariaDB refuses a JSON document nested more than 32 deep, and a payload or
# an output is stored inside up to three more levels (an idempotency record's
# answer holds the task, which holds the payload): 20 leaves room.
MAX_JSON_DEPTH = 20
TOO_DEEP = f"must not nest arrays and objects more than {MAX_JSON_DEPTH} levels deep"


def nested_too_deeply(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a parsed JSON value nests arrays and objects more than `limit`
    levels deep (a scalar is 0 deep, [] and {} are 1). Level by level, not
    recursively: the value may be as deep as the JSON parser allowed."""
    if not isinstance(value, dict | list):
        return False  # most outputs and errors: nothing to walk
    level: list[Any] = [value]
    for _ in range(limit):
        level = [
            inner
            for item in level
            if isinstance(item, dict | list)
            for inner in (item.values() if isinstance(item, dict) else item)
        ]
        if not level:
            return False
    return any(isinstance(item, dict | list) for item in level)

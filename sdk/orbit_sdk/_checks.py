"""Checks of what a program gives the SDK when it makes a client or a worker.

One check each, shared by :class:`Client`, :class:`AsyncClient` and :class:`Worker`: a value
that could never work is refused where it is given, with a ``TypeError`` (wrong kind) or a
``ValueError`` (wrong value) that names the argument, rather than failing later inside httpx,
websockets or the event loop, or retrying for ever.
"""

from __future__ import annotations

import math


def check_token(token: object) -> str:
    """The bearer token as the Authorization header can carry it. Never quoted in the error:
    it is a secret."""
    if not isinstance(token, str):
        raise TypeError(f"token must be a string, got {type(token).__name__}")
    if token and all(0x21 <= ord(ch) <= 0x7E for ch in token):
        return token
    hint = ""
    if token.strip() != token:
        hint = " (this one has whitespace at an end: strip what was read from a file)"
    raise ValueError(f"token must be a non-empty string of printable ASCII without spaces{hint}")


def check_seconds(value: object, name: str, *, allow_none: bool = False, allow_zero: bool = False) -> float | None:
    """A duration in seconds: an int or a float (not a bool, not a string), finite, and above
    zero (or zero, with `allow_zero`); None only with `allow_none`."""
    if value is None and allow_none:
        return None
    bound = ">= 0" if allow_zero else "> 0"
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "None or " if allow_none else ""
        raise TypeError(f"{name} must be {kind}a number of seconds {bound}, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return float(value)


def check_positive_seconds(value: object, name: str) -> float:
    """:func:`check_seconds` for an option that must be given: a finite number above zero."""
    seconds = check_seconds(value, name)
    assert seconds is not None  # refused above unless allow_none
    return seconds

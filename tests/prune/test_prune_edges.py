"""orbit_prune's arguments: a duration the parser takes but
whose bound lies before the year 1 is a clear CommandError (exit status 1,
one line), never an OverflowError traceback (README: bad arguments give a
message and a non-zero exit, never a traceback)."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--finished-before", "999999999d"], "--finished-before"),
        (["--finished-before", "30d", "--idempotency-before", "99999999d"], "--idempotency-before"),
    ],
    ids=["finished-before", "idempotency-before"],
)
def test_a_duration_past_the_calendar_is_refused_in_words(args, flag):
    with pytest.raises(CommandError) as refused:
        call_command("orbit_prune", *args, "--dry-run", stdout=io.StringIO())
    assert str(refused.value).startswith(f"{flag} ")
    assert "give a shorter duration" in str(refused.value)

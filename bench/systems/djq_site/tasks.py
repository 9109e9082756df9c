"""Task bodies for the django-q2 peer (referenced by dotted path in async_task)."""

import os
import time

from bench.common import ROLE_ENV, log_event

HOLD_SECONDS = 600.0


def noop(key: str) -> None:
    log_event("S", key)
    log_event("D", key)


def hold(key: str) -> None:
    log_event("S", key)
    if os.environ.get(ROLE_ENV) == "victim":
        time.sleep(HOLD_SECONDS)
    log_event("D", key)

"""Settings for the django-q2 peer: its own MariaDB database on the shared server.

Environment (set by bench/systems/django_orm_system.py): BENCH_DJQ_DB (database name),
BENCH_DJQ_WORKERS (worker processes per cluster node), BENCH_LEASE_SECONDS (``retry``:
how long a dequeued task stays invisible before another cluster may take it again).
"""

import logging
import os

SECRET_KEY = "bench-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_q"]
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": os.environ.get("BENCH_DJQ_DB", "bench_djq"),
        "USER": "root",
        "PASSWORD": "",
        "HOST": "127.0.0.1",
        "PORT": "3306",
        "OPTIONS": {"charset": "utf8mb4"},
    }
}

_lease = int(float(os.environ.get("BENCH_LEASE_SECONDS", "10")))

Q_CLUSTER = {
    "name": "bench",  # the ORM broker's queue key, shared by every node
    "orm": "default",  # the ORM broker: tasks are rows in django_q_ormq
    "workers": int(os.environ.get("BENCH_DJQ_WORKERS", "4")),
    "retry": _lease,  # visibility timeout of a dequeued task
    "timeout": max(1, _lease - 2),  # must be below retry
    "max_attempts": 0,  # retry forever (django-q2's default)
    "ack_failures": False,
    "catch_up": False,
    "sync": False,
    "save_limit": int(os.environ.get("BENCH_DJQ_SAVE_LIMIT", "250")),  # django-q2's default
    # left at django-q2's defaults: bulk=1, poll=0.2, queue_limit=workers**2
}


def _startup_and_warnings(record: logging.LogRecord) -> bool:
    # keep per-task INFO lines out (log I/O per task), but keep "... running." so the
    # harness can see a node has started
    return record.levelno >= logging.WARNING or "running" in record.getMessage()


LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"startup": {"()": "django.utils.log.CallbackFilter", "callback": _startup_and_warnings}},
    "handlers": {"console": {"class": "logging.StreamHandler", "filters": ["startup"]}},
    "loggers": {"django-q": {"handlers": ["console"], "level": "INFO", "propagate": False}},
}

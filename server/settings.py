"""Django settings for Orbit.

ORBIT_MYSQL_DSN (mysql://user:pass@host:port/db) selects MySQL, the production
store. Unset, an embedded SQLite file is used so a newcomer needs no server.
"""

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from orbit.cells import DIRECTORY, parse_cells
from orbit.cells import alias_of as cell_alias

BASE_DIR = Path(__file__).resolve().parent.parent
# In the repo, local state (the SQLite file) lives under the checkout's .local/;
# installed (`pip install .`), BASE_DIR is site-packages, so it lives under the
# working directory's .local/ instead.
LOCAL_DIR = (BASE_DIR if (BASE_DIR / "manage.py").is_file() else Path.cwd()) / ".local"

DEVELOPMENT_SECRET_KEY = "orbit-development-only-secret-key-change-me"
SECRET_KEY = os.environ.get("ORBIT_SECRET_KEY") or DEVELOPMENT_SECRET_KEY
# `orbit serve` warns when this is true outside scripts/run.
ORBIT_DEVELOPMENT_SECRET_KEY = SECRET_KEY == DEVELOPMENT_SECRET_KEY


def env_flag(name: str, default: bool = False) -> bool:
    """An ORBIT_* switch: "1" is on, "0" is off, unset or empty is `default`; anything
    else is refused, so that a mistyped value does not silently mean either."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 1 or 0, not {value!r}")
    return default if not value else value == "1"


DEBUG = env_flag("ORBIT_DEBUG")
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "orbit",
    "queues",
    "tasks",
    "workers",
    "plans",
    # The installation around the apps: its commands, and the console (admin pages,
    # dashboard, template tags, static files).
    "server",
    "console",
]

MIDDLEWARE = [
    "orbit.api.middleware.RequestIdMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # The console's static files (Django admin's and orbit/static/), served by
    # the server process itself: /v1/ never reaches this chain (orbit/api/handler.py).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    # The console may not be framed (a click-through delete); server/asgi.py
    # adds the same refusal, and frame-ancestors, to every answer (server/security.py).
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # With ORBIT_CELLS: the cell a console page shows (before the statement
    # timeout, which is set on that cell's connection).
    "console.cells.ConsoleCell",
    "console.admin_base.AdminStatementTimeout",
]
X_FRAME_OPTIONS = "DENY"

ROOT_URLCONF = "server.urls"
APPEND_SLASH = False

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # The console's templates: the repo's templates/, or, installed, the copy
        # the wheel carries in the orbit package (setup.py). Before the apps'
        # own, so they override the admin's.
        "DIRS": [BASE_DIR / "templates", BASE_DIR / "orbit" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "console.cells.picker",
            ],
        },
    },
]

ASGI_APPLICATION = "server.asgi.application"
WSGI_APPLICATION = None


def database_from_env() -> dict:
    dsn = os.environ.get("ORBIT_MYSQL_DSN", "").strip()
    if not dsn:
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("ORBIT_SQLITE_PATH", str(LOCAL_DIR / "orbit.sqlite3")),
            "OPTIONS": {
                # IMMEDIATE takes the write lock at BEGIN, so two writers never
                # deadlock upgrading a read lock; WAL lets readers run beside them.
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            # A file, not :memory:, so a live server process can share the test database.
            "TEST": {"NAME": str(LOCAL_DIR / "test.sqlite3")},
        }
    return database_from_dsn(dsn, "ORBIT_MYSQL_DSN")


def database_from_dsn(dsn: str, named: str) -> dict:
    form = f"{named} must look like mysql://user:pass@host:port/db"
    try:
        url = urlparse(dsn)
        port = url.port  # parsed on first use: a port out of range or not a number raises here
    except ValueError as exc:
        raise ValueError(f"{form} ({exc})") from None
    if url.scheme != "mysql":
        raise ValueError(form)
    if not url.path.lstrip("/"):
        raise ValueError(f"{form}: it names no database")
    return {
        "ENGINE": "orbit.db.mysql",
        "NAME": url.path.lstrip("/"),
        "USER": unquote(url.username or ""),
        "PASSWORD": unquote(url.password or ""),
        "HOST": url.hostname or "127.0.0.1",
        "PORT": str(port or 3306),
        # Under ASGI each HTTP request runs its sync view in a thread of its own,
        # so a persistent connection would be stranded with that thread. The
        # worker protocol keeps its connections on a fixed pool (orbit/db/pool.py).
        "CONN_MAX_AGE": 0,
        "OPTIONS": {
            "charset": "utf8mb4",
            # Django's default, stated because every lock order in Orbit assumes
            # no gap locks.
            "isolation_level": "read committed",
            "init_command": "SET SESSION innodb_lock_wait_timeout = 20",
            # A frozen (not dead) server must not hang requests for ever: they
            # answer 503 instead. Reads may legitimately wait on a row lock for
            # up to innodb_lock_wait_timeout, so the read timeout exceeds it.
            "connect_timeout": 5,
            "read_timeout": 30,
            "write_timeout": 30,
        },
        "TEST": {"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"},
    }


DATABASES = {"default": database_from_env()}

# Cells (orbit/cells.py): the default database is then the directory, and
# each cell is one more alias; unset, nothing changes.
ORBIT_CELLS = parse_cells(os.environ.get("ORBIT_CELLS"))
if ORBIT_CELLS:
    if DATABASES["default"]["ENGINE"] != "orbit.db.mysql":
        raise ValueError("ORBIT_CELLS needs ORBIT_MYSQL_DSN: the directory is a MySQL/MariaDB database")
    DATABASES[DIRECTORY] = {**DATABASES["default"], "TEST": {**DATABASES["default"]["TEST"], "MIRROR": "default"}}
    seen = {(DATABASES["default"]["HOST"], DATABASES["default"]["PORT"], DATABASES["default"]["NAME"]): "the directory"}
    for cell_name, cell_dsn in ORBIT_CELLS.items():
        cell_database = database_from_dsn(cell_dsn, f"ORBIT_CELLS[{cell_name!r}]")
        where = (cell_database["HOST"], cell_database["PORT"], cell_database["NAME"])
        if where in seen:
            raise ValueError(f"ORBIT_CELLS: cell {cell_name!r} is the same database as {seen[where]}")
        seen[where] = f"cell {cell_name!r}"
        DATABASES[cell_alias(cell_name)] = cell_database
    DATABASE_ROUTERS = ["orbit.cells.CellRouter"]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

# The console's times: RFC 3339, UTC, to the millisecond (console/formats).
FORMAT_MODULE_PATH = ["console.formats"]

STATIC_URL = "static/"
# Optional: where `orbit collectstatic` gathers the console's files for another
# web server. The server process needs no collect step: WhiteNoise serves the
# files where the finders find them (the installed apps' static/ directories),
# indexed once at startup, so a fresh clone and an installed server alike
# answer /static/admin/... (docs/decisions.md, Console).
STATIC_ROOT = os.environ.get("ORBIT_STATIC_ROOT") or None
WHITENOISE_USE_FINDERS = True

# Where the console's login lands when its `next` is missing or refused as off-site
# (Django's default, /accounts/profile/, is no page of Orbit's).
LOGIN_REDIRECT_URL = "admin:index"

# A task payload may be 256 KiB encoded; the body around it carries its JSON
# escaping and the other fields, so leave room before Django refuses to read.
DATA_UPLOAD_MAX_MEMORY_SIZE = 4 * 1024 * 1024

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["orbit.api.auth.BearerTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": [],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["orbit.api.parsers.StrictJSONParser"],
    "DEFAULT_METADATA_CLASS": "orbit.api.responses.EnvelopedMetadata",
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "orbit.api.responses.JSONWhateverAccepted",
    "EXCEPTION_HANDLER": "orbit.api.errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Orbit API",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
}

ORBIT_LOG_LEVEL = os.environ.get("ORBIT_LOG_LEVEL", "").strip() or "WARNING"
if ORBIT_LOG_LEVEL not in ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"):
    raise ValueError(f"ORBIT_LOG_LEVEL must be CRITICAL, ERROR, WARNING, INFO or DEBUG, not {ORBIT_LOG_LEVEL!r}")
# The database pool's threads per process (orbit/db/pool.py), parsed here so that a
# malformed value is one line, not a traceback.
_db_threads = os.environ.get("ORBIT_DB_THREADS", "8").strip()
if not (_db_threads.isascii() and _db_threads.isdigit()) or int(_db_threads) < 1:
    raise ValueError(f"ORBIT_DB_THREADS must be a whole number of at least 1, not {_db_threads!r}")
ORBIT_DB_THREADS = int(_db_threads)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": ORBIT_LOG_LEVEL},
}


def env_seconds(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"{name} must be a whole number of seconds, not {value!r}")
    return int(value)


# Served over HTTPS (directly or behind a TLS-terminating proxy): ORBIT_TLS=1
# marks the console's session and CSRF cookies Secure and sends HSTS for
# ORBIT_HSTS_SECONDS (default a year; 0 sends none). Off by default so that
# plain-HTTP development keeps working: a Secure cookie is never sent back
# over http://, and HSTS would pin a browser to https:// for the host.
ORBIT_TLS = env_flag("ORBIT_TLS")
SESSION_COOKIE_SECURE = ORBIT_TLS
CSRF_COOKIE_SECURE = ORBIT_TLS
SECURE_HSTS_SECONDS = env_seconds("ORBIT_HSTS_SECONDS", 365 * 24 * 3600) if ORBIT_TLS else 0
# Pins every subdomain of the host to HTTPS too: only when each one serves it.
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_flag("ORBIT_HSTS_INCLUDE_SUBDOMAINS")
# Behind a TLS-terminating proxy Django sees plain HTTP (no HSTS is sent, and
# the console's CSRF check compares an https:// Origin with http://). Trust
# the proxy's X-Forwarded-Proto only when asked: a server reached directly
# would take any client's word that the request was HTTPS.
if env_flag("ORBIT_TRUST_X_FORWARDED_PROTO"):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# Public address the server is reached at; printed in credential files.
ORBIT_HTTP_ADDR = os.environ.get("ORBIT_HTTP_ADDR", "127.0.0.1:8080")

# The platform operator's bearer token for GET /metrics (console/metrics_view.py);
# unset, metrics are off (404). Tenant credentials never read them.
ORBIT_METRICS_TOKEN = os.environ.get("ORBIT_METRICS_TOKEN", "") or None

# Whether this process sweeps expired leases and deadlines and fires plans
# (tasks/maintenance.py); "0" where another node does it.
ORBIT_MAINTENANCE = env_flag("ORBIT_MAINTENANCE", default=True)

# SQLite has no column or table comments; MySQL, the production store, gets them all.
SILENCED_SYSTEM_CHECKS = ["fields.W163", "models.W046"]

# True runs API views on the caller's thread and connection instead of the
# database pool; tests set it so views see the test case's transaction.
ORBIT_INLINE_DB = os.environ.get("ORBIT_INLINE_DB", "") == "1"

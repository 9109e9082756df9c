"""The credentials file both commands write: JSON, mode 0600, never overwritten
silently, and written before the credential's transaction commits, so a run
that cannot write it mints nothing. Both commands answer a failure in one line."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.management.base import CommandError
from django.db import DatabaseError, transaction

from orbit import cells
from orbit.tenancy import enter_placed
from server import cli
from tasks.serializers import is_control, is_unicode_whitespace

URL_HELP = (
    "the server's URL to write into the file, as its clients reach it "
    "(default: ORBIT_URL, else http:// + ORBIT_HTTP_ADDR, else http://127.0.0.1:8080)"
)


def server_url(given: str | None = None) -> str:
    """--url, else ORBIT_URL, else the address `orbit serve` takes by default:
    a server started with `-b`/`-p` of its own needs --url (or ORBIT_URL)."""
    return given or os.environ.get("ORBIT_URL") or f"http://{settings.ORBIT_HTTP_ADDR}"


def check_url(given: str | None) -> None:
    """Checked before anything is created: a file whose url no client can use helps nobody."""
    if given is None:
        return
    refused = CommandError(f"--url: must be an http:// or https:// URL with a host, not {given!r}")
    try:
        parts = urlsplit(given)
        parts.port  # noqa: B018 - parsed on first use: out of range or not a number raises
    except ValueError as exc:  # an unclosed [IPv6 address, a port past 65535
        raise refused from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise refused


def file_content(issued: Any, namespace: Any, queue_id: str, url: str | None = None) -> dict[str, Any]:
    """What the file holds for a credential just issued (orbit.tenancy.issue_credential)."""
    return {
        "url": server_url(url),
        "token": issued.token,
        "application_id": namespace.application_id,
        "namespace_id": namespace.id,
        "environment": namespace.environment,
        "queue_id": queue_id,
        "scopes": issued.credential.scopes,
    }


def refuse_existing(path: str, *, overwrite: bool) -> None:
    """Checked before anything is created, so a refused run mints nothing."""
    if not path:
        raise CommandError("--output: a file path is required")
    try:
        found = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return  # a new file (the write says why a path cannot be one)
    if stat.S_ISDIR(found.st_mode):
        raise CommandError(f"{path}: Is a directory")
    if not stat.S_ISREG(found.st_mode):
        # --overwrite would truncate and chmod what a link points to, or a device.
        raise CommandError(f"--output: {path} is not a regular file (a link or a device)")
    if not overwrite:
        raise CommandError(f"{path} already exists; pass --overwrite to replace it")


def check_name(option: str, value: str, longest: int) -> None:
    """A name as the API takes a key: a line break would split the commands' tab-separated lists."""
    if not 1 <= len(value) <= longest:
        raise CommandError(f"{option}: must be 1-{longest} characters")
    if any(is_control(ch) for ch in value):
        raise CommandError(f"{option}: must not contain control characters")
    if is_unicode_whitespace(value[0]) or is_unicode_whitespace(value[-1]):
        raise CommandError(f"{option}: must not start or end with whitespace")


@contextmanager
def one_line_errors() -> Iterator[None]:
    """A database or file failure as a one-line CommandError, not a traceback."""
    try:
        yield
    except DatabaseError as exc:
        if cli.reporting_database_errors():
            problem = cli.database_problem(exc)
            if problem is not None:  # as every `orbit` command says it
                raise cli.DatabaseUnusable(problem) from exc
        raise CommandError(f"database: {exc.args[-1] if exc.args else exc}") from exc
    except OSError as exc:
        raise CommandError(f"{exc.filename or 'output'}: {exc.strerror or exc}") from exc


def mint_and_write(
    path: str, *, overwrite: bool, mint: Callable[[], tuple[dict[str, Any], str]]
) -> tuple[dict[str, Any], str]:
    """Runs `mint` (which creates rows and returns the file's content and the
    credential's id) in a transaction that commits only once the file is
    written; should the commit fail after all, the file is removed again."""
    refuse_existing(path, overwrite=overwrite)
    written = False
    try:
        with transaction.atomic():
            content, credential_id = mint()
            _write(path, content, overwrite=overwrite)
            written = True
    except BaseException:
        if written:
            Path(path).unlink(missing_ok=True)
        raise
    return content, credential_id


def _write(path: str, content: dict[str, Any], *, overwrite: bool) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Never through a link put there since refuse_existing looked; the mode set on the file opened.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | (0 if overwrite else os.O_EXCL)
    fd = os.open(target, flags, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(content, handle, indent=2)
        handle.write("\n")


def enter_placed_application(name: str, cell: str | None) -> None:
    """With ORBIT_CELLS, the application's placement under `--cell`'s rules
    (an unknown cell refused by name, an existing application in another
    cell refused: a move is a move), and its cell entered for the rest of
    the command, before the transaction that makes its rows there. Without
    ORBIT_CELLS, `--cell` is refused and nothing else happens."""
    if not cells.configured():
        if cell is not None:
            raise CommandError("--cell: ORBIT_CELLS is not set; there is one cell, the default database")
        return
    try:
        enter_placed(name, cell)
    except cells.UnknownCell:
        raise  # the directory's cell, not --cell's: said as every command says it
    except LookupError as exc:
        raise CommandError(f"--cell: {exc.args[0]}") from None
    placed_in = cells.entered()
    if cell is not None and placed_in != cell:
        raise CommandError(
            f"--cell: application {name!r} is in cell {placed_in!r}; move it with orbit_move_application"
        )

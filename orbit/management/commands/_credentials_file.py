"""The credentials file both commands write: JSON, mode 0600, never overwritten silently."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError


def server_url() -> str:
    return os.environ.get("ORBIT_URL") or f"http://{settings.ORBIT_HTTP_ADDR}"


def refuse_existing(path: str, *, overwrite: bool) -> None:
    """Checked before anything is created, so a refused run mints nothing."""
    if Path(path).exists() and not overwrite:
        raise CommandError(f"{path} already exists; pass --overwrite to replace it")


def write_credentials_file(path: str, content: dict[str, Any], *, overwrite: bool) -> None:
    refuse_existing(path, overwrite=overwrite)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (0 if overwrite else os.O_EXCL)
    fd = os.open(target, flags, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(content, handle, indent=2)
        handle.write("\n")
    os.chmod(target, 0o600)

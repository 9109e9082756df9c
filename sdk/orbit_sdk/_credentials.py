"""The credentials file written by ``orbit_bootstrap`` / ``orbit_credential create``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from orbit_sdk._exceptions import CredentialsError

ENV_VAR = "ORBIT_CREDENTIALS_FILE"


@dataclass(frozen=True)
class Credentials:
    """``url`` and ``token`` are required; the rest is what the bootstrap command records."""

    url: str
    token: str = field(repr=False)
    application_id: str | None = None
    namespace_id: str | None = None
    environment: str | None = None
    queue_id: str | None = None
    scopes: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def load_credentials(path: str | os.PathLike[str] | None = None) -> Credentials:
    """Read a credentials file; ``path`` defaults to ``$ORBIT_CREDENTIALS_FILE``."""
    if path is None:
        path = os.environ.get(ENV_VAR) or None
        if path is None:
            raise CredentialsError(f"no credentials file given and {ENV_VAR} is not set")
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as exc:
        raise CredentialsError(f"cannot read credentials file {os.fspath(path)!r}: {exc}") from exc
    except ValueError as exc:
        raise CredentialsError(f"credentials file {os.fspath(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CredentialsError("credentials file must hold a JSON object")
    for name in ("url", "token"):
        if not isinstance(data.get(name), str) or not data[name]:
            raise CredentialsError(f"credentials file lacks a non-empty string {name!r}")

    def optional(name: str) -> str | None:
        value = data.get(name)
        return value if isinstance(value, str) else None

    scopes = data.get("scopes")
    known = {"url", "token", "application_id", "namespace_id", "environment", "queue_id", "scopes"}
    return Credentials(
        url=data["url"],
        token=data["token"],
        application_id=optional("application_id"),
        namespace_id=optional("namespace_id"),
        environment=optional("environment"),
        queue_id=optional("queue_id"),
        scopes=tuple(scope for scope in scopes if isinstance(scope, str)) if isinstance(scopes, list) else (),
        extra={name: value for name, value in data.items() if name not in known},
    )

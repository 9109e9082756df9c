"""Who acts: the authenticated caller (Principal), a request made by it (Actor),
and the bearer tokens `orb_<id>_<secret>`, stored only as a SHA-256 of the secret.

A domain module: the verbs, audit and idempotency take a Principal or an
Actor; the HTTP layer (orbit.api.auth) and the worker protocol only read the
token from where their transport carries it."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from orbit import cells
from orbit.db.pool import run_db
from orbit.db.rows import pk_in, read_by_pk, select_together
from orbit.errors import NotFound, PermissionDenied, Unauthenticated, Unavailable
from orbit.models import Application, Credential

TOKEN_PATTERN = re.compile(r"^orb_([0-9a-f]{32})_([A-Za-z0-9_-]{20,128})$")


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def format_token(credential_id: str, secret: str) -> str:
    return f"orb_{credential_id}_{secret}"


@dataclass(frozen=True)
class Principal:
    """The authenticated caller, as every action sees it."""

    credential_id: str
    application_id: str
    namespace_id: str
    scopes: frozenset[str]
    queue_ids: frozenset[str] | None  # None: every queue of the namespace

    @property
    def all_queues(self) -> bool:
        return self.queue_ids is None

    def require(self, *scopes: str) -> None:
        missing = [scope for scope in scopes if scope not in self.scopes]
        if missing:
            raise PermissionDenied(f"credential lacks scope {', '.join(missing)}")

    def require_all_queues(self) -> None:
        if not self.all_queues:
            raise PermissionDenied("credential's queue range does not cover all queues of the namespace")

    def covers_queue(self, queue_id: str) -> bool:
        return self.queue_ids is None or queue_id in self.queue_ids

    def require_queue(self, queue_id: str, what: str = "queue") -> None:
        """A single resource outside the range is reported as absent, never as forbidden."""
        if not self.covers_queue(queue_id):
            raise NotFound(f"{what} not found")


def principal_of(credential: Credential) -> Principal:
    """What a credential grants, as the actions see it."""
    return Principal(
        credential_id=credential.id,
        application_id=credential.application_id,
        namespace_id=credential.namespace_id,
        scopes=frozenset(credential.scopes),
        queue_ids=None if credential.queue_ids is None else frozenset(credential.queue_ids),
    )


@dataclass(frozen=True)
class Minted:
    """A credential as it was minted: its secret's hash, application,
    namespace, scopes and queue range never change (orbit.tenancy mints and
    revokes; nothing else writes the row). Only revocation does."""

    secret_hash: str
    principal: Principal

    def still_grants(self, credential: Credential | None) -> bool:
        """Whether this row, read again, still grants the principal: not
        revoked, not gone, and not changed behind orbit.tenancy's back."""
        return (
            credential is not None
            and credential.revoked_at is None
            and credential.secret_hash == self.secret_hash
            and principal_of(credential) == self.principal
        )


# Credentials this process has authenticated (bounded: emptied when full).
_MINTED: dict[str, Minted] = {}
_MINTED_LIMIT = 4096


def _token_parts(token: str) -> tuple[str, str] | None:
    """The credential id and secret of a well-formed token."""
    match = TOKEN_PATTERN.match(token)
    return None if match is None else (match[1], match[2])


async def enter_cell_of_header(authorization: str | None) -> None:
    """On the event loop, with cells: enters the cell of the bearer token's
    credential, so the request's call goes to that cell's pool
    (orbit.db.pool.run_db). A credential this process has not seen yet is
    looked up in the directory first, on the directory's pool: that pool
    never waits on a cell. A token naming no credential enters nothing (its
    call refuses it)."""
    if not authorization or not cells.configured():
        return
    parts = _token_parts(authorization.partition(" ")[2].strip())
    if parts is None:
        return
    cell = cells.known_cell_of_credential(parts[0]) or await run_db(cells.cell_of_credential, parts[0])
    if cell is not None:
        cells.enter(cell)


def _credential_and_application(credential_id: str, application_id: str) -> tuple[Credential | None, bool]:
    """The credential row in the cell entered, and whether its application
    is being moved (one round trip)."""
    credentials, applications = select_together(
        [(Credential, *pk_in(Credential, [credential_id])), (Application, *pk_in(Application, [application_id]))]
    )
    return (credentials[0] if credentials else None), any(row.moving for row in applications)


def _in_current_cell(credential_id: str) -> Credential | None:
    """With cells: the credential as its application's cell has it now (the
    cell entered: the directory names it). Not there, the application may
    have moved since this process cached its cell: the directory is read
    again, once. An application being moved answers 503 until it is served
    from its new cell."""
    application_id = cells.application_of_credential(credential_id)
    if application_id is None:
        return None
    credential, moving = _credential_and_application(credential_id, application_id)
    if credential is None:
        cells.forget(application_id)
        cells.enter_application(application_id)
        credential, moving = _credential_and_application(credential_id, application_id)
        if credential is None:
            return None
    if moving:
        cells.forget(application_id)
        raise Unavailable(cells.MOVING, retry_after=1)
    return credential


def authenticate_token(token: str) -> Principal:
    parts = _token_parts(token)
    if parts is None:
        raise Unauthenticated("invalid bearer token")
    credential_id, secret = parts
    # With cells, the directory names the credential's cell, entered for the rest of the call.
    if not cells.enter_credential(credential_id):
        raise Unauthenticated("invalid bearer token")
    if cells.configured():
        credential = _in_current_cell(credential_id)
    else:
        credential = read_by_pk(Credential, [credential_id]).get(credential_id)
    if credential is not None and credential.revoked_at is not None:
        credential = None
    if credential is None or not hmac.compare_digest(credential.secret_hash, hash_secret(secret)):
        raise Unauthenticated("invalid bearer token")
    principal = principal_of(credential)
    if len(_MINTED) >= _MINTED_LIMIT:
        _MINTED.clear()
    _MINTED[credential.id] = Minted(credential.secret_hash, principal)
    return principal


def known_credential(token: str) -> Minted | None:
    """The credential of a token this process has authenticated before, its
    secret checked, without reading the row; None if the credential is not
    known here or the secret does not match. Whether it has been revoked since
    is NOT known: the caller reads the row again before acting on the
    principal (Minted.still_grants)."""
    parts = _token_parts(token)
    if parts is None:
        return None
    credential_id, secret = parts
    minted = _MINTED.get(credential_id)
    if minted is None or not hmac.compare_digest(minted.secret_hash, hash_secret(secret)):
        return None
    return minted


def token_from_header(value: str | None) -> str:
    if not value:
        raise Unauthenticated("missing Authorization: Bearer token")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("Authorization must be 'Bearer <token>'")
    return token.strip()


@dataclass(frozen=True)
class Actor:
    """A principal's request: what audit rows and idempotency records name."""

    principal: Principal
    request_id: str

    @property
    def namespace_id(self) -> str:
        return self.principal.namespace_id

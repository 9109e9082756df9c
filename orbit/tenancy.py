"""Tenancy verbs: applications, namespaces, credentials."""

from __future__ import annotations

from dataclasses import dataclass

from django.db import IntegrityError, transaction
from django.utils import timezone

from orbit import cells
from orbit.errors import InvalidArgument, NotFound
from orbit.fields import new_id
from orbit.models import SCOPES, Application, ApplicationState, CellPlacement, Credential, Namespace
from orbit.principal import format_token, hash_secret, new_secret


@dataclass(frozen=True)
class IssuedCredential:
    credential: Credential
    token: str


def ensure_application(name: str) -> Application:
    """Returns the application of that name, creating it and its counter row.
    With cells, a new one is placed in the cell with the fewest applications
    (unless enter_placed placed it first) and its cell is entered for the
    rest of the call; an existing application stays where it is."""
    if cells.configured():
        # The placement was written before its cell's rows: created here, also
        # after a crash left the placement alone, under the placement's id.
        identity = {"id": enter_placed(name)}
    else:
        identity = {"name": name}
    existing = Application.objects.filter(**identity).first()
    if existing is not None:
        return existing
    try:
        with transaction.atomic():
            application = Application.objects.create(**{"name": name, **identity})
            ApplicationState.objects.create(application_id=application.id)
            return application
    except IntegrityError:
        return Application.objects.get(**identity)


def enter_placed(name: str, cell: str | None = None) -> str:
    """With cells: the directory's id of the application `name`, placed first
    if new (in `cell`, or the cell with the fewest applications), and its
    cell entered for the rest of the call. Its own rows are not made here:
    the caller makes them in a transaction of that cell."""
    application_id, placed_in = _placed(name, cell)
    cells.enter(placed_in)
    return application_id


def _placed(name: str, cell: str | None) -> tuple[str, str]:
    """The directory's id and cell for the application `name`, placing it first if new."""
    placement = CellPlacement.objects.filter(name=name).first()
    if placement is None:
        try:
            cells.place_application(new_id(), name, cells.choose_cell(cell))
        except IntegrityError:
            pass  # placed concurrently under another id: that placement stands
        placement = CellPlacement.objects.get(name=name)
    return placement.application_id, placement.cell


def ensure_namespace(application: Application, environment: str, name: str) -> Namespace:
    namespace, _ = Namespace.objects.get_or_create(application=application, environment=environment, name=name)
    return namespace


def check_scopes(scopes: list[str]) -> list[str]:
    unknown = [scope for scope in scopes if scope not in SCOPES]
    if unknown or not scopes:
        raise InvalidArgument(f"scopes: unknown or empty ({', '.join(unknown)}); known: {', '.join(SCOPES)}")
    return sorted(set(scopes))


def issue_credential(
    namespace: Namespace, *, scopes: list[str], queue_ids: list[str] | None, name: str = ""
) -> IssuedCredential:
    """Mints a credential; the token is returned once and only its hash is stored."""
    secret = new_secret()
    credential_id = new_id()
    if cells.configured():
        # In the directory first: a token is only ever looked up in its application's cell.
        cells.place_credential(credential_id, namespace.application_id)
    credential = Credential.objects.create(
        id=credential_id,
        application_id=namespace.application_id,
        namespace=namespace,
        name=name,
        secret_hash=hash_secret(secret),
        scopes=check_scopes(scopes),
        queue_ids=None if queue_ids is None else sorted(set(queue_ids)),
    )
    return IssuedCredential(credential=credential, token=format_token(credential.id, secret))


def revoke_credential(credential_id: str) -> Credential:
    updated = Credential.objects.filter(id=credential_id, revoked_at__isnull=True).update(revoked_at=timezone.now())
    credential = Credential.objects.filter(id=credential_id).first()
    if credential is None:
        raise NotFound("credential not found")
    if not updated and credential.revoked_at is None:
        raise NotFound("credential not found")
    return credential

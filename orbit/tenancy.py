"""Tenancy verbs: applications, namespaces, credentials."""

from __future__ import annotations

from dataclasses import dataclass

from django.db import IntegrityError, transaction
from django.utils import timezone

from orbit.errors import InvalidArgument, NotFound
from orbit.models import SCOPES, Application, ApplicationState, Credential, Namespace
from orbit.principal import format_token, hash_secret, new_secret


@dataclass(frozen=True)
class IssuedCredential:
    credential: Credential
    token: str


def ensure_application(name: str) -> Application:
    """Returns the application of that name, creating it and its counter row."""
    existing = Application.objects.filter(name=name).first()
    if existing is not None:
        return existing
    try:
        with transaction.atomic():
            application = Application.objects.create(name=name)
            ApplicationState.objects.create(application_id=application.id)
            return application
    except IntegrityError:
        return Application.objects.get(name=name)


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
    credential = Credential.objects.create(
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

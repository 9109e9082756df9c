"""Application verbs: read and configure the quotas an application holds
across all its namespaces (SPEC §7). The limits are enforced where the
counters are locked, in every submit and lease (tasks.actions.submit,
tasks.actions.dispatch); configuring them never touches a counter, so
lowering a limit never revokes what is held: it only stops new admissions
until the counters fall below it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.utils import timezone

from orbit.audit import record_management_change
from orbit.errors import NotFound, require_revision
from orbit.models import Application, ApplicationState
from orbit.principal import Actor, Principal


@dataclass(frozen=True)
class ApplicationLimits:
    max_active_attempts: int
    max_unfinished_tasks: int


def application_snapshot(application: Application, state: ApplicationState | None) -> dict[str, Any]:
    return {
        "id": application.id,
        "name": application.name,
        "max_active_attempts": application.max_active_attempts,
        "max_unfinished_tasks": application.max_unfinished_tasks,
        "active_attempts": str(state.active_attempts if state else 0),
        "unfinished_tasks": str(state.unfinished_tasks if state else 0),
        "revision": str(application.revision),
    }


def _own_application_id(principal: Principal, application_id: str) -> str:
    # A credential sees its own application only; any other id, well-formed
    # or not, is answered as absent (never reveal existence).
    if application_id != principal.application_id:
        raise NotFound("application not found")
    return application_id


def _state_of(application_id: str) -> ApplicationState | None:
    # Counters are read without a lock: a snapshot, as a queue's unfinished_tasks.
    return ApplicationState.objects.filter(application_id=application_id).first()


def application_get(*, principal: Principal, application_id: str) -> dict[str, Any]:
    application = Application.objects.filter(id=_own_application_id(principal, application_id)).first()
    if application is None:
        raise NotFound("application not found")
    return application_snapshot(application, _state_of(application.id))


def application_configure(
    *, actor: Actor, application_id: str, expected_revision: int, reason: str, limits: ApplicationLimits
) -> dict[str, Any]:
    """Full replacement of the quotas; revision + 1. Caller holds the
    transaction. Locks only the application's configuration row, which no
    other path locks (rounds read it without a lock), so it cannot take part
    in a deadlock."""
    application = (
        Application.objects.select_for_update().filter(id=_own_application_id(actor.principal, application_id)).first()
    )
    if application is None:
        raise NotFound("application not found")
    require_revision(expected_revision, application.revision)
    state = _state_of(application.id)
    before = application_snapshot(application, state)
    application.max_active_attempts = limits.max_active_attempts
    application.max_unfinished_tasks = limits.max_unfinished_tasks
    application.revision += 1
    application.updated_at = timezone.now()
    application.save(update_fields=["max_active_attempts", "max_unfinished_tasks", "revision", "updated_at"])
    after = application_snapshot(application, state)
    record_management_change(
        actor,
        action="application.configured",
        target_type="application",
        target_id=application.id,
        reason=reason,
        before=before,
        after=after,
    )
    return after

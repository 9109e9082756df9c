"""One declaration per mutating POST.

Every idempotent endpoint runs the same steps: the credential's scope, a
check of the resource the path names, then OrbitView.mutate (body,
Idempotency-Key, replay lookup, the serializer's rules, the effect). An
endpoint states what differs, with the effect as the decorated method:

    class QueueRetireView(OrbitView):
        @mutation(QueueRetireInput, scope="queues:manage", operation="queue.retire",
                  data="QueueReceipt", check=Principal.require_queue)
        def post(self, actor: Actor, fields: dict[str, Any], queue_id: str) -> tuple[int, dict[str, Any]]:
            ...

Its own module, not orbit.api.views: it applies orbit.api.schema's
`documented`, and schema imports views (the page size bounds)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api.schema import documented
from orbit.api.views import OrbitView, validated
from orbit.principal import Actor, Principal

Effect = Callable[..., tuple[int, dict[str, Any]]]
View = Callable[..., Response]

# The effect's own parameters; the rest are the path's (the resource's id).
EFFECT_PARAMETERS = ("self", "actor", "fields", "body")


def mutation(
    serializer: type,
    *,
    scope: str,
    operation: str,
    data: str,
    check: Callable[..., object] | None = None,
    as_sent: bool = False,
    created: bool = False,
    not_found: bool = False,
    operation_id: str | None = None,
) -> Callable[[Effect], View]:
    """The view method of a mutating POST whose effect is the decorated
    method `(self, actor, fields, **path) -> (status, data)`.

    `scope`: the credential must hold it. `check(principal, *path)`: runs
    next, before the body is read (a queue outside the credential's range, a
    task it cannot see). `operation`: the idempotency record's operation; its
    target is the path's id ("" for a create). `serializer` validates the
    body into `fields`; `as_sent`: the effect also gets the body as sent
    (`body=`). `data`, `created`, `not_found`, `operation_id`: the OpenAPI
    entry (orbit.api.schema.documented)."""

    def decorate(effect: Effect) -> View:
        path_names = [name for name in inspect.signature(effect).parameters if name not in EFFECT_PARAMETERS]

        def post(self: OrbitView, request: Request, **path: str) -> Response:
            principal: Principal = self.principal(request)
            principal.require(scope)
            if check is not None:
                check(principal, *path.values())

            def validate(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
                return validated(serializer, body), body

            def run(actor: Actor, checked: tuple[dict[str, Any], dict[str, Any]]) -> tuple[int, dict[str, Any]]:
                fields, body = checked
                return effect(self, actor, fields, **path, **({"body": body} if as_sent else {}))

            return self.mutate(
                request,
                operation=operation,
                target=next(iter(path.values()), ""),
                validate=validate,
                effect=run,
            )

        # documented() and DRF read the method as a view's: (self, request, *path ids).
        positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
        post.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(name, positional) for name in ("self", "request", *path_names)]
        )
        # The effect's docstring, if any, is the endpoint's OpenAPI description, as a plain method's would be.
        post.__qualname__, post.__module__, post.__doc__ = effect.__qualname__, effect.__module__, effect.__doc__
        return documented(
            serializer,
            data=data,
            operation_id=operation_id,
            created=created,
            idempotent=True,
            not_found=not_found,
        )(post)

    return decorate

"""factory-boy factories: the one place tests build rows from."""

from __future__ import annotations

import factory

from orbit import cells
from orbit.fields import new_id
from orbit.models import SCOPES, Application, ApplicationState, Namespace
from orbit.tenancy import IssuedCredential, issue_credential
from queues.models import Queue, QueueState


class ApplicationFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Application
        skip_postgeneration_save = True

    name = factory.Sequence(lambda n: f"app-{n}")

    @classmethod
    def _create(cls, model_class: type[Application], *args: object, **kwargs: object) -> Application:
        if cells.configured():
            # As every application is made under cells: placed in the directory
            # first, in the cell the test entered (tests/support/suite_cells.py).
            kwargs.setdefault("id", new_id())
            cells.place_application(str(kwargs["id"]), str(kwargs["name"]), cells.entered() or cells.names()[0])
        return super()._create(model_class, *args, **kwargs)

    @factory.post_generation
    def state(self, create: bool, extracted: object, **kwargs: object) -> None:
        if create:
            ApplicationState.objects.get_or_create(application_id=self.id)


class NamespaceFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Namespace

    application = factory.SubFactory(ApplicationFactory)
    environment = "test"
    name = factory.Sequence(lambda n: f"ns-{n}")


class QueueFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Queue
        skip_postgeneration_save = True

    namespace_id = factory.LazyAttribute(lambda o: o.namespace.id)
    application_id = factory.LazyAttribute(lambda o: o.namespace.application_id)
    name = factory.Sequence(lambda n: f"queue-{n}")
    max_concurrency = 8
    rate_per_second = 100
    max_unfinished_tasks = 100_000

    class Params:
        namespace = factory.SubFactory(NamespaceFactory)

    @factory.post_generation
    def state(self, create: bool, extracted: object, **kwargs: object) -> None:
        if create:
            QueueState.objects.get_or_create(queue_id=self.id, application_id=self.application_id)


# Every scope a queue/task/worker test needs (plans and applications are not built yet).
ALL_SCOPES = [scope for scope in SCOPES if scope not in ("plans:manage", "applications:manage")]


def make_credential(
    namespace: Namespace, scopes: list[str] | None = None, queue_ids: list[str] | None = None
) -> IssuedCredential:
    return issue_credential(namespace, scopes=scopes or ALL_SCOPES, queue_ids=queue_ids)

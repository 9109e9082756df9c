from __future__ import annotations

from typing import Any, cast

from django.core.management.base import BaseCommand, CommandError, CommandParser
from rest_framework.exceptions import ValidationError

from orbit.api.errors import translate
from orbit.models import Application, Namespace
from orbit.principal import Actor, principal_of
from orbit.tenancy import ensure_application, ensure_namespace, issue_credential
from queues.actions import QueueLimits, queue_create
from queues.models import Queue
from queues.serializers import QueueCreateInput
from server.management.commands._credentials_file import (
    URL_HELP,
    check_name,
    check_url,
    enter_placed_application,
    file_content,
    mint_and_write,
    one_line_errors,
    refuse_existing,
)

# keys:manage goes with queues:manage (SPEC §12): who shapes the queues shapes their keys too.
MANAGE_SCOPES = ["queues:manage", "keys:manage", "queues:read", "tasks:submit", "tasks:read", "tasks:cancel"]
WORKER_SCOPES = ["workers:connect", "workers:consume"]


def check_queue_settings(options: dict[str, Any]) -> None:
    """The queue obeys the rules of POST /v1/queues; checked before anything is created."""
    fields = QueueCreateInput(
        data={
            "name": options["queue"],
            "max_concurrency": options["max_concurrency"],
            "rate_per_second": options["rate_per_second"],
        }
    )
    if not fields.is_valid():
        error = translate(ValidationError(fields.errors))
        raise CommandError(f"invalid queue settings: {error.message if error else fields.errors}")


class Command(BaseCommand):
    help = "Create (or reuse, by name) an application, namespace and queue, and mint a credential for them."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--application", required=True)
        parser.add_argument("--namespace", required=True)
        parser.add_argument("--environment", required=True)
        parser.add_argument("--queue", required=True)
        parser.add_argument("--max-concurrency", type=int, default=8)
        parser.add_argument("--rate-per-second", type=int, default=100)
        parser.add_argument("--worker-access", action="store_true", help="also grant workers:connect/consume")
        parser.add_argument("--output", required=True, help="credentials file to write (mode 0600)")
        parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
        parser.add_argument("--url", help=URL_HELP)
        parser.add_argument(
            "--cell", help="with ORBIT_CELLS: the cell of a new application (default: the one with the fewest)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        with one_line_errors():
            self.bootstrap(options)

    def bootstrap(self, options: dict[str, Any]) -> None:
        refuse_existing(options["output"], overwrite=options["overwrite"])
        check_url(options["url"])
        # CharFields: each has its max_length.
        check_name("--application", options["application"], cast(int, Application._meta.get_field("name").max_length))
        check_name(
            "--environment", options["environment"], cast(int, Namespace._meta.get_field("environment").max_length)
        )
        check_name("--namespace", options["namespace"], cast(int, Namespace._meta.get_field("name").max_length))
        check_queue_settings(options)
        scopes = MANAGE_SCOPES + (WORKER_SCOPES if options["worker_access"] else [])
        # Placed (and its cell entered) before the transaction that mints in that cell.
        enter_placed_application(options["application"], options["cell"])

        def mint() -> tuple[dict[str, Any], str]:
            application = ensure_application(options["application"])
            namespace = ensure_namespace(application, options["environment"], options["namespace"])
            queue = Queue.objects.filter(namespace_id=namespace.id, name=options["queue"]).first()
            if queue is not None and queue.retired_at is not None:
                raise CommandError(f"queue {options['queue']!r} of this namespace is retired; choose another name")
            issued = issue_credential(namespace, scopes=scopes, queue_ids=None, name="bootstrap")
            if queue is None:
                # Through the verb, as the API creates one: its audit row (naming the
                # credential just minted) and its queue.created event.
                actor = Actor(principal=principal_of(issued.credential), request_id="")
                limits = QueueLimits(options["max_concurrency"], options["rate_per_second"], 0)
                queue_id = queue_create(actor=actor, name=options["queue"], limits=limits)["id"]
            else:
                queue_id = queue.id
            return file_content(issued, namespace, queue_id, options["url"]), issued.credential.id

        content, credential_id = mint_and_write(options["output"], overwrite=options["overwrite"], mint=mint)
        self.stdout.write(f"wrote {options['output']} (credential {credential_id}, queue {content['queue_id']})")

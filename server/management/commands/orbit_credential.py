from __future__ import annotations

from typing import Any, cast

from django.core.management.base import BaseCommand, CommandError, CommandParser

from orbit import cells
from orbit.errors import OrbitError
from orbit.models import Application, Credential, Namespace
from orbit.tenancy import issue_credential, revoke_credential
from queues.models import Queue
from server.management.commands._credentials_file import (
    URL_HELP,
    check_url,
    file_content,
    mint_and_write,
    one_line_errors,
    refuse_existing,
)


class Command(BaseCommand):
    help = "Create, revoke or list credentials."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        create = sub.add_parser("create")
        create.add_argument("--application", required=True)
        create.add_argument("--namespace", required=True)
        create.add_argument("--environment", required=True)
        create.add_argument("--scopes", required=True, help="comma-separated scopes")
        create.add_argument("--queues", required=True, help="'all' or comma-separated queue ids")
        create.add_argument("--name", default="")
        create.add_argument("--output", required=True)
        create.add_argument("--overwrite", action="store_true")
        create.add_argument("--url", help=URL_HELP)
        revoke = sub.add_parser("revoke")
        revoke.add_argument("credential_id")
        sub.add_parser("list")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            with one_line_errors():
                getattr(self, f"handle_{options['verb']}")(options)
        except OrbitError as exc:
            raise CommandError(exc.message) from exc

    def handle_create(self, options: dict[str, Any]) -> None:
        refuse_existing(options["output"], overwrite=options["overwrite"])
        check_url(options["url"])
        longest = cast(int, Credential._meta.get_field("name").max_length)  # a CharField's
        if len(options["name"]) > longest:
            raise CommandError(f"--name: must be at most {longest} characters")
        application = (
            Application.objects.filter(name=options["application"]).first()
            if cells.enter_application_named(options["application"])
            else None
        )
        namespace = (
            Namespace.objects.filter(
                application_id=application.id, environment=options["environment"], name=options["namespace"]
            ).first()
            if application
            else None
        )
        if namespace is None:
            raise CommandError("no such application/environment/namespace; run orbit_bootstrap first")
        queue_ids = None if options["queues"] == "all" else [q for q in options["queues"].split(",") if q]
        if queue_ids is not None:
            known = set(Queue.objects.filter(namespace_id=namespace.id, id__in=queue_ids).values_list("id", flat=True))
            unknown = [queue_id for queue_id in queue_ids if queue_id not in known]
            if unknown or not queue_ids:
                raise CommandError(f"--queues: not queues of this namespace: {', '.join(unknown) or '(none given)'}")

        def mint() -> tuple[dict[str, Any], str]:
            issued = issue_credential(
                namespace,
                scopes=[s for s in options["scopes"].split(",") if s],
                queue_ids=queue_ids,
                name=options["name"],
            )
            return file_content(issued, namespace, (queue_ids or [""])[0], options["url"]), issued.credential.id

        _, credential_id = mint_and_write(options["output"], overwrite=options["overwrite"], mint=mint)
        self.stdout.write(f"wrote {options['output']} (credential {credential_id})")

    def handle_revoke(self, options: dict[str, Any]) -> None:
        if not cells.enter_credential(options["credential_id"]):
            raise CommandError("credential not found")
        credential = revoke_credential(options["credential_id"])
        self.stdout.write(f"revoked {credential.id}")

    def handle_list(self, options: dict[str, Any]) -> None:
        listed = []
        for cell in cells.each():
            with cells.in_cell(cell):
                listed += list(Credential.objects.order_by("created_at"))
        for credential in sorted(listed, key=lambda credential: credential.created_at):
            state = "revoked" if credential.revoked_at else "active"
            queues = "all" if credential.queue_ids is None else ",".join(credential.queue_ids)
            self.stdout.write(
                f"{credential.id}\t{state}\t{credential.namespace_id}\t{credential.name}\t"
                f"{','.join(credential.scopes)}\t{queues}"
            )

"""Read-only Django admin: operators inspect, the verbs change.

Every counter and permit changes only through the actions modules; the admin
never writes, so it cannot break an invariant.

Pages stay fast over millions of tasks and attempts: counts stop at
ADMIN_ROW_CAP, columns sort only where an index serves the order, search
matches the whole term exactly through indexes, and a statement that would
still run away is stopped by the database (AdminStatementTimeout)."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from functools import cached_property
from typing import Any, cast

from django.apps import apps
from django.contrib import admin
from django.contrib.admin.exceptions import NotRegistered
from django.contrib.admin.utils import display_for_field
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.db import DatabaseError, connection
from django.db.models import Model, Q, QuerySet
from django.db.models.constants import LOOKUP_SEP
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from console.cells import unavailable_page
from orbit.models import Namespace

# 100 pages of 100 rows; older rows are reached through filters and search.
ADMIN_ROW_CAP = 10_000
ADMIN_STATEMENT_SECONDS = 10


class CappedCountPaginator(Paginator):
    """COUNT(*) over a LIMIT ADMIN_ROW_CAP subquery: a full count of a
    million-row table is a scan on every page load."""

    capped = False

    @cached_property
    def count(self) -> int:
        # Without the list's ORDER BY: a count needs no order, and with it the
        # subquery walked or sorted the ordering index (seconds on a rare state).
        # A count that reached the cap stopped there: it reads "10,000+".
        # The admin pages querysets (the stubs allow any sequence).
        counted = cast(QuerySet, self.object_list).order_by()[:ADMIN_ROW_CAP].count()
        self.capped = counted >= ADMIN_ROW_CAP
        return counted


def count_text(count: int, capped: bool) -> str:
    """A count as the console prints it: 10,000 style, "10,000+" when capped."""
    return f"{count:,}+" if capped else f"{count:,}"


def format_ms(value: datetime | None) -> str:
    """RFC 3339, UTC, with its milliseconds and microseconds always written
    (the console's times, as console/formats writes the admin's fields)."""
    if value is None:
        return "—"
    return value.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def may_view(request: HttpRequest, model: type[Model]) -> bool:
    """What the model's own admin lets this user see (its list and pages)."""
    try:
        model_admin = admin.site.get_model_admin(model)
    except NotRegistered:
        return False
    return model_admin.has_view_permission(request)


def viewable_models(request: HttpRequest) -> frozenset[str]:
    """The labels ("tasks.Attempt") of every model whose rows this user may
    see. A page shows another model's rows (a panel, a name, a link to its
    page) only when it is one of them: a least-privilege role that may view
    tasks but not attempts must not read the attempts on a task's page."""
    return frozenset(model._meta.label for model in admin.site._registry if may_view(request, model))


def viewable(obj: Any, model: type[Model]) -> bool:
    """Whether the user of this page may see `model`'s rows, as the row its
    admin read carries it (console_viewable, set by ReadOnlyAdmin.get_object
    and the lists); a row without it shows none (a display the admin did not
    prepare leaks nothing)."""
    return model._meta.label in getattr(obj, "console_viewable", frozenset())


def change_url(model: Any, pk: Any) -> str:
    opts = model._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[pk])


def link(url: str, text: Any) -> SafeString:
    return format_html('<a href="{}">{}</a>', url, text)


def key_url(namespace_id: str, key: str) -> str:
    """The console page of a concurrency key, found by its namespace and bytes."""
    from urllib.parse import urlencode

    return reverse("admin:tasks_concurrencykey_by_key") + "?" + urlencode({"namespace": namespace_id, "key": key})


def short_id(value: str) -> SafeString:
    """A 32-hex id as a list prints it: its first 8, the whole in the tooltip
    (the full ids made the task and attempt lists wider than the window)."""
    if len(value) <= 12:
        return format_html("{}", value)
    return format_html('<span class="orbit-id" title="{}">{}…</span>', value, value[:8])


# Id columns the console shows as the named row they point to, linked to its
# page: (model, the fields of its label; none: the id itself, shortened in lists).
NAMED_IDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "namespace_id": ("orbit.Namespace", ("environment", "name")),
    "application_id": ("orbit.Application", ("name",)),
    "credential_id": ("orbit.Credential", ("name",)),
    "queue_id": ("queues.Queue", ("name",)),
    "plan_id": ("plans.Plan", ("name",)),
    "task_id": ("tasks.Task", ()),
    "holder_task_id": ("tasks.Task", ()),
    "holder_attempt_id": ("tasks.Attempt", ()),
}


def labels_of(field: str, ids: set[str]) -> dict[str, str]:
    """The labels of these ids of one NAMED_IDS field: one query, by primary key."""
    model_name, label_fields = NAMED_IDS[field]
    ids = {value for value in ids if value}
    if not label_fields or not ids:
        return {}
    model = apps.get_model(model_name)
    rows = model.objects.filter(pk__in=ids).values_list("pk", *label_fields)
    return {pk: "/".join(str(part) for part in parts if part) or pk for pk, *parts in rows}


def named_id_display(field: str, in_list: bool) -> Callable[[Any], SafeString | str]:
    model_name, label_fields = NAMED_IDS[field]

    def display(obj: Any) -> SafeString | str:
        value = getattr(obj, field)
        if not value:
            return "—"
        if not viewable(obj, apps.get_model(model_name)):
            # The id is this row's own column; the name and the page are the other model's.
            return short_id(value) if in_list or not label_fields else value
        labels = getattr(obj, "console_labels", None)
        label = (labels if labels is not None else labels_of(field, {value})).get(value)
        if label is None:
            text: Any = short_id(value) if in_list or not label_fields else value
        else:
            text = label
        return link(change_url(apps.get_model(model_name), value), text)

    description = field.removeprefix("holder_").removesuffix("_id").replace("_", " ")
    return admin.display(description=f"holder {description}" if field.startswith("holder_") else description)(display)


# Unicode's explicit direction controls (embeddings, overrides, isolates,
# marks): "\u202e0001 DSU" would read "USD 1000".
BIDI_CONTROLS = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def escape_direction_controls(text: str) -> str:
    """JSON text with each direction control written as its escape, which
    reads the same to a JSON parser and turns nothing around on the page."""
    return BIDI_CONTROLS.sub(lambda found: f"\\u{ord(found[0]):04x}", text)


def json_text(field: Any, empty: str) -> Callable[[Any], str]:
    """A JSON column as Django's read-only page writes it, direction controls escaped."""

    def display(obj: Any) -> str:
        return escape_direction_controls(display_for_field(getattr(obj, field.name), field, empty))

    return admin.display(description=str(field.verbose_name))(display)


def plain_boolean(field: str, description: str) -> Callable[[Any], str]:
    """A boolean as words: Django's red ✗ read as an alarm on a normal state."""

    def display(obj: Any) -> str:
        return "yes" if getattr(obj, field) else "no"

    return admin.display(description=description)(display)


class IndexOrderChangeList(ChangeList):
    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        capped = getattr(self.paginator, "capped", False)
        self.result_count_text = count_text(self.result_count, capped)
        self.result_list = list(self.result_list)
        # Each row carries the models its user may view to the columns' displays
        # (viewable()), as ReadOnlyAdmin.get_object does a page's row.
        shown = viewable_models(request)
        for row in self.result_list:
            row.console_viewable = shown
        attach = getattr(self.model_admin, "attach_labels", None)
        if attach is not None:
            attach(self.result_list, shown)
        decorate = getattr(self.model_admin, "decorate_results", None)
        if decorate is not None:
            decorate(request, self.result_list)

    def get_ordering_field(self, field_name: Any) -> Any:
        # Django only hides the other headers' links; ?o= would still sort.
        # ChangeList is given the admin's get_sortable_by(), never None (the stubs allow it).
        if field_name not in self.sortable_by:  # type: ignore[operator]
            return None
        return super().get_ordering_field(field_name)

    def _get_deterministic_ordering(self, ordering: list[Any]) -> list[Any]:
        # Django appends the admin's own ordering after a column's (leased_at,
        # -leased_at) and breaks ties with "-pk" whatever the direction. A field
        # is kept once, and the tie-break takes the first field's direction: a
        # secondary index ends in the primary key, so one index serves either
        # direction without a filesort.
        seen: set[str] = set()
        kept = []
        for part in ordering:
            name = part.lstrip("-") if isinstance(part, str) else None
            if name is None or name not in seen:
                kept.append(part)
            if name is not None:
                seen.add(name)
        # django-stubs leave out ChangeList's private _get_deterministic_ordering.
        ordering = super()._get_deterministic_ordering(kept)  # type: ignore[misc]
        first = ordering[0] if ordering else None
        if len(ordering) > 1 and ordering[-1] == "-pk" and isinstance(first, str) and not first.startswith("-"):
            ordering[-1] = "pk"
        return ordering


class ReadOnlyAdmin(admin.ModelAdmin):
    """A large table's admin also sets `sortable_by` to the columns an index
    orders (empty: its ordering only): sorting by any other column is a
    filesort of every row."""

    list_per_page = 100
    show_full_result_count = False
    # Django's "Show counts" (?_facets) counts every filter choice over the
    # whole list, past ADMIN_ROW_CAP: never offered, never run.
    show_facets = admin.ShowFacets.NEVER
    paginator = CappedCountPaginator
    # Searched for the whole term (spaces included), exactly.
    exact_search_fields: tuple[str, ...] = ()
    # The same, for fields whose index starts with namespace_id: matched with
    # every namespace id in front, so that index serves the search.
    namespaced_search_fields: tuple[str, ...] = ()

    def __init__(self, model: Any, admin_site: Any) -> None:
        super().__init__(model, admin_site)
        # The model's id columns that name a row, and its booleans, each as a
        # display of this admin (list_display and the page take them by name).
        self.replaced_fields: dict[str, str] = {}
        # The same on its page (a named id written whole).
        self.page_fields: dict[str, str] = {}
        for model_field in model._meta.fields:
            name = model_field.name
            # A foreign key (Namespace.application) by its id column, as the
            # others: Django's own link to the row ignored the user's permissions.
            column = model_field.attname
            if column in NAMED_IDS and not model_field.primary_key:
                setattr(self, f"{column}_link", named_id_display(column, in_list=True))
                setattr(self, f"{column}_page", named_id_display(column, in_list=False))
                self.replaced_fields[name] = f"{column}_link"
                self.page_fields[name] = f"{column}_page"
            elif model_field.get_internal_type() == "BooleanField":
                setattr(self, f"{name}_text", plain_boolean(name, str(model_field.verbose_name)))
                self.replaced_fields[name] = f"{name}_text"
            elif model_field.get_internal_type() == "JSONField":
                setattr(self, f"{name}_json", json_text(model_field, self.get_empty_value_display()))
                self.replaced_fields[name] = f"{name}_json"

    def attach_labels(self, rows: list[Any], shown: frozenset[str]) -> None:
        """Every named id of a list page, one query per kind of id the user may view."""
        fields = [name for name in self.replaced_fields if name in NAMED_IDS and NAMED_IDS[name][0] in shown]
        labels = {field: labels_of(field, {getattr(row, field) for row in rows}) for field in fields}
        for row in rows:
            row.console_labels = {
                getattr(row, field): labels[field][getattr(row, field)]
                for field in fields
                if getattr(row, field) in labels[field]
            }

    def get_list_display(self, request: HttpRequest) -> Any:
        # In place: a column's ?o= index stays what it was.
        return [self.replaced_fields.get(name, name) if isinstance(name, str) else name for name in self.list_display]

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        page_names = {**self.replaced_fields, **self.page_fields}
        return [
            # Orbit's fieldsets are flat lists of names (get_fields), never nested tuples.
            (title, {**options, "fields": [page_names.get(cast(str, name), name) for name in options["fields"]]})
            for title, options in super().get_fieldsets(request, obj)
        ]

    def object_label(self, obj: Any) -> str:
        """The page's name for a row: its own, else its model's and primary key
        (Django's "AuditEntry object (1)" read as a fault)."""
        text = str(obj)
        if text.endswith(f"object ({obj.pk})"):
            return f"{self.opts.verbose_name} {obj.pk}"
        return text

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        obj = super().get_object(request, object_id, from_field)
        if obj is not None:
            # Read by the page's displays (viewable()), which Django gives the row only.
            obj.console_viewable = viewable_models(request)
        return obj

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = dict(extra_context or {})
        obj = self.get_object(request, object_id)
        if obj is not None:
            context.setdefault("console_label", self.object_label(obj))
            context.setdefault("subtitle", context["console_label"])
        return super().change_view(request, object_id, form_url, extra_context=context)

    def get_search_fields(self, request: HttpRequest) -> tuple[str, ...]:
        return self.exact_search_fields + self.namespaced_search_fields

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        """The rows of the first field, in declaration order, that holds the term:
        one OR over every field became an index merge whose matches were all
        sorted (seconds for a queue id with 25,000 tasks)."""
        term = search_term.strip()
        if not term:
            return queryset, False
        namespace_ids = list(Namespace.objects.values_list("id", flat=True)) if self.namespaced_search_fields else []
        conditions = [Q(**{field: term}) for field in self.exact_search_fields] + [
            Q(namespace_id__in=namespace_ids, **{field: term}) for field in self.namespaced_search_fields
        ]
        for condition in conditions:
            found = queryset.filter(condition)
            if found.exists():
                return found, False
        return queryset.none(), False

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        # Django applies any field named in the query string as a filter
        # (?handler=x: a walk of every task); only the declared filters are
        # allowed, anything else is refused (400).
        # Orbit's admins list field names and SimpleListFilter classes only.
        # A declared filter takes only its own lookups (its choices are exact
        # values): ?state__regex= or ?state__contains= would read every row.
        declared = {entry if isinstance(entry, str) else entry.parameter_name for entry in self.list_filter}  # type: ignore[union-attr]
        field, _, kind = lookup.partition(LOOKUP_SEP)
        if field not in declared or kind not in ("", "exact", "isnull"):
            return False
        # Django 5.2 always passes the request; the stubs require it.
        return super().lookup_allowed(lookup, value, request)  # type: ignore[arg-type]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return IndexOrderChangeList

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class FixedChoicesFilter(admin.SimpleListFilter):
    """A list filter over known values: Django's own filter finds the choices
    with SELECT DISTINCT over the whole table."""

    choices_of: tuple[str, ...] = ()

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(value, value) for value in self.choices_of]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        # fixed_choices_filter gives every such filter its parameter_name.
        return queryset if value is None else queryset.filter(**{cast(str, self.parameter_name): value})


def fixed_choices_filter(field: str, values: tuple[str, ...]) -> type[FixedChoicesFilter]:
    return type(
        f"{field.title()}Filter",
        (FixedChoicesFilter,),
        {"title": field.replace("_", " "), "parameter_name": field, "choices_of": values},
    )


class AdminStatementTimeout:
    """Admin pages ask MariaDB to stop any statement after
    ADMIN_STATEMENT_SECONDS: a page the client gave up on (read_timeout) must
    not leave its sort running on the primary, once per reload."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith("/admin/") or connection.vendor != "mysql":
            return self.get_response(request)
        try:
            # MySQL 8 bounds SELECTs only, in milliseconds.
            variable, limit = (
                ("max_statement_time", ADMIN_STATEMENT_SECONDS)
                if connection.mysql_is_mariadb  # type: ignore[attr-defined]  # the MySQL backend's, vendor checked above
                else ("max_execution_time", ADMIN_STATEMENT_SECONDS * 1000)
            )
            with connection.cursor() as cursor:
                cursor.execute(f"SET SESSION {variable} = {limit}")
        except DatabaseError as error:
            # The first statements of every console page: a database (a cell) that does not answer.
            unavailable = unavailable_page(request, error)
            if unavailable is None:
                raise
            return unavailable
        try:
            return self.get_response(request)
        finally:
            with connection.cursor() as cursor:
                cursor.execute(f"SET SESSION {variable} = DEFAULT")

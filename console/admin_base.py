"""Read-only Django admin: operators inspect, the verbs change.

Every counter and permit changes only through the actions modules; the admin
never writes, so it cannot break an invariant.

Pages stay fast over millions of tasks and attempts: counts stop at
ADMIN_ROW_CAP, columns sort only where an index serves the order, search
matches the whole term exactly through indexes, and a statement that would
still run away is stopped by the database (AdminStatementTimeout)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from functools import cached_property
from typing import Any, cast

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.db import connection
from django.db.models import Q, QuerySet
from django.db.models.constants import LOOKUP_SEP
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

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


def change_url(model: Any, pk: Any) -> str:
    opts = model._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[pk])


def link(url: str, text: Any) -> SafeString:
    return format_html('<a href="{}">{}</a>', url, text)


def key_url(namespace_id: str, key: str) -> str:
    """The console page of a concurrency key, found by its namespace and bytes."""
    from urllib.parse import urlencode

    return reverse("admin:tasks_concurrencykey_by_key") + "?" + urlencode({"namespace": namespace_id, "key": key})


class IndexOrderChangeList(ChangeList):
    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        capped = getattr(self.paginator, "capped", False)
        self.result_count_text = count_text(self.result_count, capped)
        decorate = getattr(self.model_admin, "decorate_results", None)
        if decorate is not None:
            self.result_list = list(self.result_list)
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
    paginator = CappedCountPaginator
    # Searched for the whole term (spaces included), exactly.
    exact_search_fields: tuple[str, ...] = ()
    # The same, for fields whose index starts with namespace_id: matched with
    # every namespace id in front, so that index serves the search.
    namespaced_search_fields: tuple[str, ...] = ()

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
        declared = {entry if isinstance(entry, str) else entry.parameter_name for entry in self.list_filter}  # type: ignore[union-attr]
        # Django 5.2 always passes the request; the stubs require it.
        return lookup.split(LOOKUP_SEP)[0] in declared and super().lookup_allowed(lookup, value, request)  # type: ignore[arg-type]

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
        # MySQL 8 bounds SELECTs only, in milliseconds.
        variable, limit = (
            ("max_statement_time", ADMIN_STATEMENT_SECONDS)
            if connection.mysql_is_mariadb  # type: ignore[attr-defined]  # the MySQL backend's, vendor checked above
            else ("max_execution_time", ADMIN_STATEMENT_SECONDS * 1000)
        )
        with connection.cursor() as cursor:
            cursor.execute(f"SET SESSION {variable} = {limit}")
        try:
            return self.get_response(request)
        finally:
            with connection.cursor() as cursor:
                cursor.execute(f"SET SESSION {variable} = DEFAULT")

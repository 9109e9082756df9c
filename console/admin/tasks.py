from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.db.models import Model
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.utils.safestring import SafeString

from console import data
from console.admin_base import (
    ReadOnlyAdmin,
    change_url,
    count_text,
    format_ms,
    key_url,
    link,
    may_view,
    short_id,
    viewable,
    viewable_models,
)
from console.dependency_graph import task_graph
from orbit.models import Application, Namespace
from queues.models import Queue
from tasks.actions import keys
from tasks.models import Attempt, ConcurrencyKey, KeyPolicy, Task, WorkerIdentity

# The task's fields its page leaves out: key_ready is a dispatch flag of the
# engine (true on unkeyed tasks too), not something an operator acts on.
TASK_INTERNAL_FIELDS = ("key_ready",)


# The model whose row a blocker's facts are read from, by its code (the others'
# facts are the task's own): a user who may not view it reads the code and
# message only, as a credential reads the API's (tasks.actions.blockers). A
# task_id fact is another task's, which the task page's user may view.
BLOCKER_FACT_MODELS: dict[str, type[Model]] = {
    "QUEUE_AT_MAX_CONCURRENCY": Queue,
    "START_WINDOW_FULL": Queue,
    "APPLICATION_QUOTA_FULL": Application,
    # The holder: its attempt, the attempt's worker, since when.
    "KEY_HELD": Attempt,
    "KEY_AT_CAPACITY": ConcurrencyKey,
    "KEY_RATE_LIMITED": ConcurrencyKey,
    "KEY_TOKENS_EXHAUSTED": ConcurrencyKey,
}


def fact_shown(code: str, name: str, shown: frozenset[str]) -> bool:
    """Whether a blocker's fact is for a user who may view the models in `shown`."""
    if name == "task_id":
        return Task._meta.label in shown
    if name == "policy_id" and KeyPolicy._meta.label not in shown:
        return False
    model = BLOCKER_FACT_MODELS.get(code)
    return model is None or model._meta.label in shown


def fact_url(name: str, value: Any, shown: frozenset[str]) -> str:
    """The console page a blocker's fact names, where it has one the user may open."""
    if not isinstance(value, str) or not value:
        return ""
    if name == "attempt_id" and Attempt._meta.label in shown:
        return change_url(Attempt, value)
    if name == "task_id" and Task._meta.label in shown:
        return change_url(Task, value)
    if name == "worker_id" and WorkerIdentity._meta.label in shown:
        # Encoded: a worker_id may hold &, #, + or %, which would otherwise be the link's.
        workers = reverse(f"admin:{WorkerIdentity._meta.app_label}_workeridentity_changelist")
        return workers + "?" + urlencode({"q": value})
    return ""


def with_fact_links(item: dict[str, Any], shown: frozenset[str]) -> dict[str, Any]:
    facts = [
        (name, value, fact_url(name, value, shown))
        for name, value in item.items()
        if name not in ("code", "message") and fact_shown(item["code"], name, shown)
    ]
    return {**item, "facts": facts}


# Shown on a task's page below its fields, readable (orbit.console: pretty JSON).
TASK_JSON_FIELDS = ("payload", "output", "last_error")
# Shown in the dependencies panel instead, each id linked with its state.
TASK_PANEL_FIELDS = ("depends_on",)


def task_blockers(task: Task, shown: frozenset[str]) -> dict[str, Any] | None:
    """Why a WAITING task is not running, from the lease's own predicates
    (tasks.actions.blockers, the answer of GET /v1/tasks/{id}/blockers),
    each fact only where the user may view its model; None where this
    server has no such verb."""
    try:
        from tasks.actions import blockers
    except ImportError:
        return None
    operator_view = getattr(blockers, "blockers_of", None)
    if operator_view is None:
        return None
    if task.state != "WAITING":
        # What the state means, with the attempt that holds it (the newest),
        # for a user who may view attempts.
        attempts = data.task_attempts(task.id) if Attempt._meta.label in shown else []
        return {"state": task.state, "items": [], "attempt": attempts[-1] if attempts else None}
    answer = operator_view(task)
    items = answer["items"] if isinstance(answer, dict) else answer
    return {"state": task.state, "items": [with_fact_links(item, shown) for item in items]}


def with_queue_names(tasks: list[Task], shown: frozenset[str]) -> list[Task]:
    """The tasks, each with its queue's name (the key page's table) for a user who may view queues."""
    if Queue._meta.label not in shown:
        return tasks
    names = dict(Queue.objects.filter(id__in={t.queue_id for t in tasks}).values_list("id", "name"))
    for task in tasks:
        task.queue_name = names.get(task.queue_id, task.queue_id)  # type: ignore[attr-defined]  # read by the template
    return tasks


@admin.register(Task)
class TaskAdmin(ReadOnlyAdmin):
    list_display = (
        "task_id_short",
        "queue_link",
        "handler",
        "state",
        "priority",
        "attempts",
        "key_link",
        "fairness_key",
        "available_at",
        "created_at",
    )
    list_filter = ("state",)
    exact_search_fields = ("id", "queue_id")
    namespaced_search_fields = ("concurrency_key", "business_key")
    sortable_by = ()
    change_form_template = "admin/tasks/task/change_form.html"

    # A list of field names is one of the layouts Django takes (the stubs' list is invariant).
    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:  # type: ignore[override]
        # The generated sweep columns repeat the deadlines shown; the JSON fields have their own panel.
        return [
            f.name
            for f in Task._meta.fields
            if f.name not in (*TASK_JSON_FIELDS, *TASK_INTERNAL_FIELDS, *TASK_PANEL_FIELDS) and not f.generated
        ]

    def queue_of_search(self, request: HttpRequest) -> Queue | None:
        """The queue a search term names (every console link to a queue's tasks is ?q=<queue id>)."""
        term = request.GET.get("q", "").strip()
        if len(term) != 32:
            return None
        return Queue.objects.filter(id=term).only("id", "namespace_id").first()

    def get_ordering(self, request: HttpRequest) -> Any:
        # Newest first within a queue: idx_task_ns_queue (namespace_id,
        # queue_id, created_at) orders it, the search below fixing both. The
        # whole table has no index on created_at: unnarrowed, the id orders it.
        if self.queue_of_search(request) is not None:
            return ("-created_at",)
        return super().get_ordering(request)

    def get_search_results(self, request: HttpRequest, queryset: Any, search_term: str) -> Any:
        queue = self.queue_of_search(request)
        if queue is not None and search_term.strip() == queue.id:
            return queryset.filter(namespace_id=queue.namespace_id, queue_id=queue.id), False
        return super().get_search_results(request, queryset, search_term)

    @admin.display(description="id")
    def task_id_short(self, task: Task) -> SafeString:
        return short_id(task.id)

    def decorate_results(self, request: HttpRequest, tasks: list[Task]) -> None:
        if not may_view(request, Queue):
            return
        names = dict(Queue.objects.filter(id__in={t.queue_id for t in tasks}).values_list("id", "name"))
        for task in tasks:
            task.queue_name = names.get(task.queue_id, task.queue_id)  # type: ignore[attr-defined]  # read by queue_link()

    @admin.display(description="queue")
    def queue_link(self, task: Task) -> SafeString:
        if not viewable(task, Queue):
            return short_id(task.queue_id)
        return link(change_url(Queue, task.queue_id), getattr(task, "queue_name", task.queue_id))

    @admin.display(description="concurrency key")
    def key_link(self, task: Task) -> SafeString | str:
        if not task.concurrency_key:
            return ""
        if not viewable(task, ConcurrencyKey):
            return task.concurrency_key
        return link(key_url(task.namespace_id, task.concurrency_key), task.concurrency_key)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        task = Task.objects.filter(pk=object_id).first()
        context = dict(extra_context or {})
        if task is not None:
            # Another model's rows, names and links only for a user who may view that model.
            shown = viewable_models(request)
            queues_viewable = Queue._meta.label in shown
            attempts_viewable = Attempt._meta.label in shown
            queue = Queue.objects.filter(id=task.queue_id).only("id", "name").first() if queues_viewable else None
            context.update(
                task=task,
                queue_url=change_url(Queue, task.queue_id) if queues_viewable else "",
                queue_name=queue.name if queue else task.queue_id,
                key_url=(
                    key_url(task.namespace_id, task.concurrency_key)
                    if task.concurrency_key and ConcurrencyKey._meta.label in shown
                    else ""
                ),
                attempts_viewable=attempts_viewable,
                attempts=data.task_attempts(task.id) if attempts_viewable else [],
                attempts_url=reverse("admin:tasks_attempt_changelist") + f"?q={task.id}",
                json_fields=[(name, getattr(task, name)) for name in TASK_JSON_FIELDS],
                blockers=task_blockers(task, shown),
                **dependency_context(request, task, shown),
            )
        return super().change_view(request, object_id, form_url, extra_context=context)


def page_query(request: HttpRequest, name: str, number: int) -> str:
    """The page's query string with `name` (dependencies_page or
    dependents_page) set to `number`, the other table's page kept."""
    query = request.GET.copy()
    query[name] = str(number)
    return "?" + query.urlencode()


def page_links(request: HttpRequest, name: str, page: data.LinkedPage) -> dict[str, str]:
    links = {}
    if page.number > 1:
        links["first"] = page_query(request, name, 1)
        links["previous"] = page_query(request, name, page.number - 1)
    if page.has_next:
        links["next"] = page_query(request, name, page.number + 1)
        if not page.capped:
            links["last"] = page_query(request, name, page.pages)
    return links


def dependency_context(request: HttpRequest, task: Task, shown: frozenset[str]) -> dict[str, Any]:
    """The task page's dependencies, dependents and graph (console.data.task_dependencies):
    tasks, as the page's own; their queues by name for a user who may view queues."""
    found = data.task_dependencies(
        task,
        dependencies_page=data.page_number(request.GET.get("dependencies_page")),
        dependents_page=data.page_number(request.GET.get("dependents_page")),
    )
    rows = [*found.dependencies.rows, *found.dependents.rows, *found.parents, *found.children, *found.waiting_for]
    if Queue._meta.label not in shown:
        for row in rows:
            row.queue_name = short_id(row.queue_id) if row.queue_id else ""
    href_of = {row.task_id: change_url(Task, row.task_id) for row in rows if row.state is not None}
    href_of[task.id] = change_url(Task, task.id)
    itself = data.Linked(task_id=task.id, state=task.state, handler=task.handler, queue_id=task.queue_id)
    return {
        "dependencies": found.dependencies,
        "dependencies_links": page_links(request, "dependencies_page", found.dependencies),
        "dependents": found.dependents,
        "dependents_count": count_text(found.dependents.count, found.dependents.capped),
        "dependents_links": page_links(request, "dependents_page", found.dependents),
        "graph": task_graph(itself, found.parents, found.dependencies, found.children, found.dependents, href_of),
        "waiting_for": found.waiting_for,
    }


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin):
    """Token history: every attempt of a key with its token, in lease order."""

    list_display = (
        "attempt_id_short",
        "task_link",
        "state",
        "epoch",
        "number",
        "key_link",
        "concurrency_token",
        "worker_id",
        "leased_at",
        "started_at",
        "finished_at",
    )
    list_filter = ("state",)
    exact_search_fields = ("task_id", "worker_id")
    namespaced_search_fields = ("concurrency_key",)
    ordering = ("-leased_at",)
    sortable_by = ("leased_at",)
    readonly_fields = ("task_link", "key_link")

    # A list of field names is one of the layouts Django takes (the stubs' list is invariant).
    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:  # type: ignore[override]
        # task_id is shown as the task's link (console.admin_base.NAMED_IDS).
        return ["key_link", *[f.name for f in Attempt._meta.fields]]

    @admin.display(description="id")
    def attempt_id_short(self, attempt: Attempt) -> SafeString:
        return short_id(attempt.id)

    @admin.display(description="task")
    def task_link(self, attempt: Attempt) -> SafeString:
        if not viewable(attempt, Task):
            return short_id(attempt.task_id)
        return link(change_url(Task, attempt.task_id), short_id(attempt.task_id))

    @admin.display(description="concurrency key")
    def key_link(self, attempt: Attempt) -> SafeString | str:
        if not attempt.concurrency_key:
            return ""
        if not viewable(attempt, ConcurrencyKey):
            return attempt.concurrency_key
        return link(key_url(attempt.namespace_id, attempt.concurrency_key), attempt.concurrency_key)


def policy_context(described: dict[str, Any], shown: frozenset[str]) -> dict[str, Any]:
    """The key's policy (None: the default, capacity 1 and no rate) and its
    console page, when the key policy admin is there; for a user who may not
    view policies, only that one applies (policy_hidden)."""
    policy_id = described.get("policy_id")
    if policy_id and KeyPolicy._meta.label not in shown:
        return {"policy": None, "policy_url": "", "policy_hidden": True}
    policy = KeyPolicy.objects.filter(id=policy_id).first() if policy_id else None
    url = ""
    if policy is not None:
        try:
            url = change_url(KeyPolicy, policy.id)
        except NoReverseMatch:  # the policy has no page of its own
            url = ""
    return {"policy": policy, "policy_url": url}


def holders_with_links(described: dict[str, Any], shown: frozenset[str]) -> list[dict[str, Any]]:
    """The key's holders by slot: attempts, for a user who may view attempts
    (their tasks linked for one who may view tasks)."""
    if Attempt._meta.label not in shown:
        return []
    tasks_viewable = Task._meta.label in shown
    return [
        {
            **holder,
            "attempt_url": change_url(Attempt, holder["attempt_id"]),
            "task_url": change_url(Task, holder["task_id"]) if tasks_viewable else "",
        }
        for holder in described.get("holders", [])
    ]


def key_viewing(shown: frozenset[str]) -> dict[str, bool]:
    """Which of a key page's panels of other models' rows its user may see
    (templates/admin/tasks/concurrencykey/key_panels.html): the holders and
    token history are attempts, the waiting tasks tasks."""
    return {
        "attempts_viewable": Attempt._meta.label in shown,
        "tasks_viewable": Task._meta.label in shown,
        "queues_viewable": Queue._meta.label in shown,
    }


@admin.register(ConcurrencyKey)
class ConcurrencyKeyAdmin(ReadOnlyAdmin):
    """A key's page: its policy (capacity, rate), its holders by slot, its
    rate state, highest token, waiting tasks and token history (its attempts,
    newest lease first). Never reset, never deleted."""

    list_display = ("key", "namespace_id", "version", "holders", "capacity", "holder_attempt_id", "updated_at")
    namespaced_search_fields = ("key",)
    change_form_template = "admin/tasks/concurrencykey/change_form.html"

    def object_label(self, obj: Any) -> str:
        return str(obj.key)

    def get_urls(self) -> list[URLPattern]:
        return [
            path("by-key/", self.admin_site.admin_view(self.by_key_view), name="tasks_concurrencykey_by_key"),
            *super().get_urls(),
        ]

    def by_key_view(self, request: HttpRequest) -> HttpResponse:
        """A task's or attempt's key, by namespace and bytes: its row's page, or
        (before its first lease made the row) what is known of it."""
        if not self.has_view_permission(request):
            raise Http404
        namespace_id = request.GET.get("namespace", "")
        key = request.GET.get("key", "")
        row = keys.key_row(namespace_id, key) if key else None
        if row is not None:
            return HttpResponseRedirect(change_url(ConcurrencyKey, row.pk))
        try:
            described = keys.describe_key(namespace_id, key) if key else None
        except Exception:  # NotFound: neither a row nor a waiting task
            described = None
        if described is None:
            raise Http404("no such concurrency key")
        shown = viewable_models(request)
        viewing = key_viewing(shown)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Concurrency key {key}",
            "key": key,
            "namespace": (
                Namespace.objects.filter(id=namespace_id).first() if Namespace._meta.label in shown else None
            ),
            "described": described,
            "holders": holders_with_links(described, shown),
            **policy_context(described, shown),
            **viewing,
            "history": [],
            "waiting": (
                with_queue_names(data.key_waiting_tasks(namespace_id, key), shown) if viewing["tasks_viewable"] else []
            ),
        }
        return TemplateResponse(request, "admin/tasks/concurrencykey/unleased.html", context)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        numeric = object_id.isascii() and object_id.isdigit()  # str.isdigit() alone takes "²", which int() refuses
        row = ConcurrencyKey.objects.filter(pk=object_id).first() if numeric else None
        context = dict(extra_context or {})
        if row is not None:
            described = keys.describe_keys(row.namespace_id, [row])[0]
            # Another model's rows, names and links only for a user who may view that model.
            shown = viewable_models(request)
            viewing = key_viewing(shown)
            holder = described.get("holder") if viewing["attempts_viewable"] else None
            context.update(
                subtitle=f"Concurrency key {row.key}",
                row=row,
                described=described,
                holders=holders_with_links(described, shown),
                **policy_context(described, shown),
                **viewing,
                holder=holder,
                holder_since=holder and holder.get("since"),
                holder_attempt_url=(
                    change_url(Attempt, row.holder_attempt_id)
                    if row.holder_attempt_id and viewing["attempts_viewable"]
                    else ""
                ),
                holder_task_url=(
                    change_url(Task, row.holder_task_id) if row.holder_task_id and viewing["tasks_viewable"] else ""
                ),
                history=data.key_history(row.namespace_id, row.key) if viewing["attempts_viewable"] else [],
                history_limit=data.TOKEN_HISTORY,
                waiting=(
                    with_queue_names(data.key_waiting_tasks(row.namespace_id, row.key), shown)
                    if viewing["tasks_viewable"]
                    else []
                ),
                namespace=(
                    Namespace.objects.filter(id=row.namespace_id).first() if Namespace._meta.label in shown else None
                ),
                updated=format_ms(row.updated_at),
            )
        return super().change_view(request, object_id, form_url, extra_context=context)

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import include, path, re_path

from console.metrics_view import MetricsView
from orbit import views
from orbit.api.errors import json_error_view
from orbit.api.pooled import pooled
from orbit.api.schema import OpenApiDocumentView
from server import probes
from tasks import key_views

# The console's icon (its pages also carry it inline): a browser or a bookmark that asks
# for /favicon.ico gets it, not a 404 in its console.
FAVICON = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
    '<circle cx="8" cy="8" r="6" fill="none" stroke="#2b5f8a" stroke-width="3"/></svg>'
)


def favicon(request: HttpRequest) -> HttpResponse:
    if request.method not in ("GET", "HEAD"):
        return probes.method_not_allowed(request)
    response = HttpResponse(FAVICON, content_type="image/svg+xml")
    response["Cache-Control"] = "public, max-age=86400"
    return response


urlpatterns = [
    path("favicon.ico", favicon),
    path("admin/", admin.site.urls),
    path("v1/openapi.json", OpenApiDocumentView.as_view(), name="openapi"),
    path("metrics", pooled(MetricsView.as_view())),
    # Probes: plain async views, outside DRF's credential authentication.
    path("healthz", probes.healthz, name="healthz"),
    path("readyz", probes.readyz, name="readyz"),
    re_path(
        r"^v1/applications/(?P<application_id>[^/:]+):configure$", pooled(views.ApplicationConfigureView.as_view())
    ),
    re_path(r"^v1/applications/(?P<application_id>[^/:]+)$", pooled(views.ApplicationDetailView.as_view())),
    re_path(r"^v1/events$", pooled(views.EventListView.as_view())),
    re_path(r"^v1/concurrency-keys$", pooled(key_views.ConcurrencyKeyCollectionView.as_view())),
    # The key URL-encoded; decoded, it may hold any character, "/" too.
    re_path(r"^v1/concurrency-keys/(?P<key>(?s:.+))$", pooled(key_views.ConcurrencyKeyDetailView.as_view())),
    path("", include("queues.urls")),
    path("", include("tasks.urls")),
    path("", include("plans.urls")),
]

handler404 = json_error_view("NOT_FOUND", 404, "no such endpoint")
handler500 = json_error_view("INTERNAL", 500, "internal error")
handler400 = json_error_view("INVALID_ARGUMENT", 400, "bad request")

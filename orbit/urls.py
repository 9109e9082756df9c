from django.contrib import admin
from django.urls import include, path

from orbit.api.errors import json_error_view
from orbit.api.schema import OpenApiDocumentView
from orbit.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("v1/openapi.json", OpenApiDocumentView.as_view(), name="openapi"),
    path("metrics", metrics_view),
    path("", include("queues.urls")),
    path("", include("tasks.urls")),
]

handler404 = json_error_view("NOT_FOUND", 404, "no such endpoint")
handler500 = json_error_view("INTERNAL", 500, "internal error")
handler400 = json_error_view("INVALID_ARGUMENT", 400, "bad request")

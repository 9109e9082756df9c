from django.urls import re_path

from orbit.api.pooled import pooled
from tasks import views

TASK = r"(?P<task_id>[^/:]+)"

urlpatterns = [
    re_path(r"^v1/tasks$", pooled(views.TaskCollectionView.as_view())),
    re_path(r"^v1/tasks:batch$", pooled(views.TaskBatchView.as_view())),
    re_path(rf"^v1/tasks/{TASK}:cancel$", pooled(views.TaskCancelView.as_view())),
    re_path(rf"^v1/tasks/{TASK}:resolve$", pooled(views.TaskResolveView.as_view())),
    re_path(rf"^v1/tasks/{TASK}/attempts$", pooled(views.TaskAttemptsView.as_view())),
    re_path(rf"^v1/tasks/{TASK}/blockers$", pooled(views.TaskBlockersView.as_view())),
    re_path(rf"^v1/tasks/{TASK}$", pooled(views.TaskDetailView.as_view())),
    re_path(r"^v1/attempts/(?P<attempt_id>[^/:]+)$", pooled(views.AttemptDetailView.as_view())),
]

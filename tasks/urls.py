from django.urls import re_path

from tasks import views

TASK = r"(?P<task_id>[^/:]+)"

urlpatterns = [
    re_path(r"^v1/tasks$", views.TaskCollectionView.as_view()),
    re_path(rf"^v1/tasks/{TASK}:cancel$", views.TaskCancelView.as_view()),
    re_path(rf"^v1/tasks/{TASK}/attempts$", views.TaskAttemptsView.as_view()),
    re_path(rf"^v1/tasks/{TASK}$", views.TaskDetailView.as_view()),
    re_path(r"^v1/attempts/(?P<attempt_id>[^/:]+)$", views.AttemptDetailView.as_view()),
]

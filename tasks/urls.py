from django.urls import re_path

from orbit.api.pooled import pooled
from tasks import policy_views, views

TASK = r"(?P<task_id>[^/:]+)"
POLICY = r"(?P<policy_id>[^/:]+)"

urlpatterns = [
    re_path(r"^v1/tasks$", pooled(views.TaskCollectionView.as_view())),
    re_path(r"^v1/tasks:batch$", pooled(views.TaskBatchView.as_view())),
    re_path(rf"^v1/tasks/{TASK}:cancel$", pooled(views.TaskCancelView.as_view())),
    re_path(rf"^v1/tasks/{TASK}:resolve$", pooled(views.TaskResolveView.as_view())),
    re_path(rf"^v1/tasks/{TASK}/attempts$", pooled(views.TaskAttemptsView.as_view())),
    re_path(rf"^v1/tasks/{TASK}/blockers$", pooled(views.TaskBlockersView.as_view())),
    re_path(rf"^v1/tasks/{TASK}/dependencies$", pooled(views.TaskDependenciesView.as_view())),
    re_path(rf"^v1/tasks/{TASK}/dependents$", pooled(views.TaskDependentsView.as_view())),
    re_path(rf"^v1/tasks/{TASK}$", pooled(views.TaskDetailView.as_view())),
    re_path(r"^v1/key-policies$", pooled(policy_views.KeyPolicyCollectionView.as_view())),
    re_path(rf"^v1/key-policies/{POLICY}:configure$", pooled(policy_views.KeyPolicyConfigureView.as_view())),
    re_path(rf"^v1/key-policies/{POLICY}:retire$", pooled(policy_views.KeyPolicyRetireView.as_view())),
    re_path(rf"^v1/key-policies/{POLICY}$", pooled(policy_views.KeyPolicyDetailView.as_view())),
    re_path(r"^v1/attempts/(?P<attempt_id>[^/:]+)$", pooled(views.AttemptDetailView.as_view())),
]

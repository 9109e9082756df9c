from django.urls import re_path

from orbit.api.pooled import pooled
from plans import views

ID = r"(?P<plan_id>[^/:]+)"

urlpatterns = [
    re_path(r"^v1/plans$", pooled(views.PlanCollectionView.as_view())),
    re_path(rf"^v1/plans/{ID}:update$", pooled(views.PlanUpdateView.as_view())),
    re_path(rf"^v1/plans/{ID}:pause$", pooled(views.PlanPauseView.as_view())),
    re_path(rf"^v1/plans/{ID}:resume$", pooled(views.PlanResumeView.as_view())),
    re_path(rf"^v1/plans/{ID}:retire$", pooled(views.PlanRetireView.as_view())),
    re_path(rf"^v1/plans/{ID}/triggers$", pooled(views.PlanTriggersView.as_view())),
    re_path(rf"^v1/plans/{ID}$", pooled(views.PlanDetailView.as_view())),
]

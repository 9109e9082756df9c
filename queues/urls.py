from django.urls import re_path

from orbit.api.pooled import pooled
from queues import views

ID = r"(?P<queue_id>[^/:]+)"

urlpatterns = [
    re_path(r"^v1/queues$", pooled(views.QueueCollectionView.as_view())),
    re_path(rf"^v1/queues/{ID}:configure$", pooled(views.QueueConfigureView.as_view())),
    re_path(rf"^v1/queues/{ID}:retire$", pooled(views.QueueRetireView.as_view())),
    re_path(rf"^v1/queues/{ID}$", pooled(views.QueueDetailView.as_view())),
]

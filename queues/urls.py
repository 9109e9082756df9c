from django.urls import re_path

from queues import views

ID = r"(?P<queue_id>[^/:]+)"

urlpatterns = [
    re_path(r"^v1/queues$", views.QueueCollectionView.as_view()),
    re_path(rf"^v1/queues/{ID}:configure$", views.QueueConfigureView.as_view()),
    re_path(rf"^v1/queues/{ID}:retire$", views.QueueRetireView.as_view()),
    re_path(rf"^v1/queues/{ID}$", views.QueueDetailView.as_view()),
]

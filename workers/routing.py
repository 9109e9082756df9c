from django.urls import path

from workers.consumers import WorkerConsumer

websocket_urlpatterns = [path("v1/workers/connect", WorkerConsumer.as_asgi())]

from django.urls import path

from workers.consumers import WorkerConsumer

# Channels routes with Django's path(), whose stubs know views only.
websocket_urlpatterns = [path("v1/workers/connect", WorkerConsumer.as_asgi())]  # type: ignore[arg-type]

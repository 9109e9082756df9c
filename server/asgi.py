"""ASGI entry point: HTTP through Django, the worker protocol through Channels."""

import gc
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")
django_asgi_app = get_asgi_application()

from orbit.db.mysql import base as mysql_backend  # noqa: E402

mysql_backend.serving = True  # before any request opens a connection

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from orbit.api.handler import ApiHandler, split_http  # noqa: E402
from server.security import frame_protected  # noqa: E402
from server.serving import tune_twisted  # noqa: E402
from tasks import submit_route  # noqa: E402
from tasks.maintenance import start_background_maintenance  # noqa: E402
from tasks.wakeups import listen_to_siblings  # noqa: E402
from workers.routing import websocket_urlpatterns  # noqa: E402

tune_twisted()
# Every server process recovers expired leases and sweeps deadlines.
start_background_maintenance()
listen_to_siblings()

application = ProtocolTypeRouter(
    {
        # Every answer, the API's and the console's, refuses to be framed.
        "http": frame_protected(
            split_http(ApiHandler(routes={("POST", submit_route.PATH): submit_route.answer}), django_asgi_app)
        ),
        # Django's path() makes Channels' routes; the stubs want their own pattern type.
        "websocket": URLRouter(websocket_urlpatterns),  # type: ignore[arg-type]
    }
)

# What start-up made (Django's apps and models, the URL patterns, every module) lives as long
# as the process: frozen out of the collector's view, the full collections that the rounds'
# allocations set off every few thousand requests walk only what requests made.
gc.collect()
gc.freeze()

"""ASGI entry point: `uvicorn controlplane.asgi:application`.

HTTP goes to Django: the API (`/v1/…`, `/healthz`) to a handler without middleware, everything
else (the console) to one with the full stack. Django runs each sync middleware hook of an async
request in its sync thread: the five console middlewares (sessions, CSRF, auth, …) cost an API
request ten thread hops, most of the time the gateway added (bench/gateway.py), and an API call
authenticated by its Bearer key needs none of them. WebSockets go to Channels: `/ws/events`,
authenticated by the console's session and refused from origins outside ALLOWED_HOSTS.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# Django must be set up before anything imports models (the consumers do).
django_application = get_asgi_application()

from django.conf import settings  # noqa: E402
from django.core import signals  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402
from django.db import close_old_connections  # noqa: E402


class ApiHandler(ASGIHandler):
    """Django for the API, built with `settings.API_MIDDLEWARE` instead of `MIDDLEWARE`."""

    def load_middleware(self, is_async: bool = False) -> None:
        # BaseHandler reads settings.MIDDLEWARE; swap it only while this handler is built (at
        # import, before any request).
        console_middleware = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.API_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = console_middleware


api_application = ApiHandler()

# Django closes stale database connections on every request_started and request_finished; under
# ASGI each of those sync receivers is a hop to the sync thread, two per request. API requests
# skip them: the completion views use the database only in the shared thread pool, whose
# admission step calls `close_old_connections` itself, and the DRF views run, as every sync view
# under Django's ASGI handler, in a thread of their own request (asgiref's
# ThreadSensitiveContext), whose connection ends with it. That is about 2 ms a request here
# (bench/gateway.py), and no queue behind the sync thread under load. Console requests, sent by
# the plain ASGIHandler, keep Django's behaviour.
signals.request_started.disconnect(close_old_connections)
signals.request_finished.disconnect(close_old_connections)
signals.request_started.connect(close_old_connections, sender=ASGIHandler)
signals.request_finished.connect(close_old_connections, sender=ASGIHandler)


async def http_application(scope, receive, send):
    """`/v1/…` and `/healthz` to the API handler, the rest to the console's."""
    path = scope.get("path", "")
    target = api_application if path.startswith(API_PREFIXES) else django_application
    await target(scope, receive, send)


API_PREFIXES = ("/v1/", "/healthz")

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.urls import path  # noqa: E402

from controlplane.events.consumers import EventsConsumer  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": http_application,
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter([path("ws/events", EventsConsumer.as_asgi())]))
        ),
    }
)

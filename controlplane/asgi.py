"""ASGI entry point: `uvicorn controlplane.asgi:application`.

HTTP goes to Django: the API (`/v1/…`, `/healthz`) to a handler without middleware, everything
else (the console) to one with the full stack. Django runs each sync middleware hook of an async
request in its sync thread: the five console middlewares (sessions, CSRF, auth, …) cost an API
request ten thread hops (docs/performance.md), and an API call
authenticated by its Bearer key needs none of them. WebSockets go to Channels: `/ws/events`,
authenticated by the console's session and refused from origins outside ALLOWED_HOSTS.
"""

import asyncio
import contextlib
import functools
import os

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# Django must be set up before anything imports models (the consumers do).
django_application = get_asgi_application()

from django.conf import settings  # noqa: E402
from django.core import signals  # noqa: E402
from django.core.cache import close_caches  # noqa: E402
from django.core.handlers.asgi import (  # noqa: E402
    ASGIHandler,
    RequestAborted,
    get_script_prefix,
    set_script_prefix,
)
from django.core.handlers.base import reset_urlconf  # noqa: E402
from django.db import close_old_connections, reset_queries  # noqa: E402
from django.urls import Resolver404, get_resolver  # noqa: E402


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

    async def __call__(self, scope, receive, send):
        # Django wraps every request in a ThreadSensitiveContext, which gives the request's
        # thread-sensitive sync code a thread of its own: started for the request, and joined
        # by one more thread started at its end. A sync view needs it. An async view does its
        # sync work in the shared pool (thread_sensitive=False), and its response is closed on
        # the loop (handle_async_view), or for a stream by the one process-wide sync thread. So
        # an async view runs without it: two thread starts fewer per completion
        # (docs/performance.md).
        if scope["type"] == "http" and _is_async_view(scope["path"]):
            await self.handle_async_view(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def handle_async_view(self, scope, receive, send) -> None:
        """Django's `ASGIHandler.handle`, step for step (the view raced against the client's
        disconnect, which cancels it), except that a response that is not streamed is closed
        here on the event loop. Django closes every response with `sync_to_async`, a hop to the
        process's sync thread and back; an API response's close runs no receiver (this module
        moves them to the console's handler) and closes nothing that blocks, and the hop is worth
        saving on every API response (docs/performance.md). A streamed
        response's close, which closes its iterator, keeps Django's hop."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        await signals.request_started.asend(sender=self.__class__, scope=scope)
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            await _close(error_response)
            return
        try:
            response = await self._race_disconnect(request, receive, send)
            if response is None:
                await signals.request_finished.asend(sender=self.__class__)
            else:
                await _close(response)
        finally:
            body_file.close()

    async def _race_disconnect(self, request, receive, send):
        """Run the view and send its response, cancelled should the client disconnect first;
        the response, or None when it was cancelled."""
        disconnect = asyncio.create_task(self.listen_for_disconnect(receive))
        view = asyncio.create_task(self._respond(request, send))
        await asyncio.wait([disconnect, view], return_when=asyncio.FIRST_COMPLETED)
        for task in (disconnect, view):  # the listener first: its end cancels the view
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            elif not task.cancelled():
                with contextlib.suppress(RequestAborted):
                    task.result()
        return None if view.cancelled() else view.result()

    async def _respond(self, request, send):
        response = await self.run_get_response(request)
        with contextlib.suppress(asyncio.CancelledError):  # the client left during the send
            await self.send_response(response, send)
        return response


async def _close(response) -> None:
    if response.streaming:
        await sync_to_async(response.close)()
    else:
        response.close()


@functools.lru_cache(maxsize=1024)
def _is_async_view(path: str) -> bool:
    """Whether `path` resolves to an async view (cached: the handler resolves it again)."""
    try:
        match = get_resolver().resolve(path)
    except Resolver404:
        return False
    return iscoroutinefunction(match.func)


api_application = ApiHandler()

# Django hangs sync receivers on request_started and request_finished: it closes stale database
# connections (both), resets the query log (started), closes the cache connections and resets
# the urlconf (finished). Under ASGI the sync receivers of a signal run in the request's sync
# thread (asgiref's ThreadSensitiveContext), which Django starts for the request just for them:
# a thread start and two hops for each API request. API requests skip them all: the completion
# views use the database only in the shared thread pool, whose admission step calls
# `close_old_connections` itself; the DRF views run, as every sync view under Django's ASGI
# handler, in that thread of their own request, whose connection ends with it; the API sets no
# urlconf, uses no cache, and keeps no query log (DEBUG is off in production). Dropping them
# saves each API request a thread start and two hops (docs/performance.md). Console requests,
# sent by the plain
# ASGIHandler, keep Django's behaviour.
for signal, receiver in (
    (signals.request_started, reset_queries),
    (signals.request_started, close_old_connections),
    (signals.request_finished, close_caches),
    (signals.request_finished, reset_urlconf),
    (signals.request_finished, close_old_connections),
):
    signal.disconnect(receiver)
    signal.connect(receiver, sender=ASGIHandler)


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

from controlplane.dispatch.tokenization import load_catalog_tokenizers  # noqa: E402
from controlplane.events.consumers import EventsConsumer  # noqa: E402


async def lifespan_application(scope, receive, send):
    """ASGI lifespan: at start-up, before the port serves, load the catalog's tokenizers, so a
    new gateway process's first requests do not pay for them (uvicorn's `--lifespan auto`)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await sync_to_async(_load_tokenizers, thread_sensitive=False)()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _load_tokenizers() -> None:
    try:
        load_catalog_tokenizers()
    finally:
        close_old_connections()


application = ProtocolTypeRouter(
    {
        "http": http_application,
        "lifespan": lifespan_application,
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter([path("ws/events", EventsConsumer.as_asgi())]))
        ),
    }
)

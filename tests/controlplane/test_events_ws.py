"""`/ws/events` through the whole ASGI application (origin check, session auth, the consumer):
who may connect, and that a socket only ever carries its own org's events."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import async_to_sync
from asgiref.testing import ApplicationCommunicator
from channels.db import database_sync_to_async
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model
from django.test import Client

from controlplane.accounts.models import Membership, Org
from controlplane.events.models import Event
from controlplane.events.push import bind_loop

ORIGIN = "http://127.0.0.1:8000"


@pytest.fixture
def memory_layer(settings):
    """The in-memory channel layer. Changing CHANNEL_LAYERS makes channels drop its cached layer
    instances (setting_changed), here and again when pytest-django restores the setting, so no
    layer, or its asyncio queues, outlives the test."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


@pytest.fixture
def orgs(transactional_db):
    return Org.objects.create(slug="acme", name="Acme"), Org.objects.create(
        slug="globex", name="Globex"
    )


def session_cookie(username: str, org: Org | None) -> str:
    """Sign a new user in through Django's test client; returns their `sessionid`."""
    user = get_user_model().objects.create_user(username=username, password="pw")
    if org is not None:
        Membership.objects.create(org=org, user=user)
    client = Client()
    client.force_login(user)
    return client.cookies[django_settings.SESSION_COOKIE_NAME].value


class EventSocket(ApplicationCommunicator):
    """A WebSocket client speaking ASGI to the application, as channels.testing's
    WebsocketCommunicator does (that module needs daphne, which Hearth does not install)."""

    def __init__(self, application, headers: list[tuple[bytes, bytes]]) -> None:
        scope = {
            "type": "websocket",
            "path": "/ws/events",
            "query_string": b"",
            "headers": headers,
            "subprotocols": [],
        }
        super().__init__(application, scope)

    async def connect(self, timeout: float = 2) -> tuple[bool, int | None]:
        """(True, None) when accepted, (False, close code) when refused."""
        await self.send_input({"type": "websocket.connect"})
        response = await self.receive_output(timeout)
        if response["type"] == "websocket.close":
            return False, response.get("code", 1000)
        assert response["type"] == "websocket.accept", response
        return True, None

    async def receive_json_from(self, timeout: float = 2) -> dict:
        response = await self.receive_output(timeout)
        assert response["type"] == "websocket.send", response
        return json.loads(response["text"])

    async def disconnect(self, timeout: float = 2) -> None:
        """What the server sends the application when the socket closes (or was refused)."""
        await self.send_input({"type": "websocket.disconnect", "code": 1000})
        await self.wait(timeout)


def communicator(cookie: str | None = None, origin: str = ORIGIN) -> EventSocket:
    from controlplane.asgi import application

    headers = [(b"host", b"127.0.0.1:8000"), (b"origin", origin.encode())]
    if cookie is not None:
        headers.append((b"cookie", f"sessionid={cookie}".encode()))
    return EventSocket(application, headers)


def run(scenario) -> None:
    """Run `scenario` on one event loop, set up as embedded mode sets up its server's: the
    in-memory layer's queues belong to that loop, so pushes are bound to it."""

    async def on_one_loop() -> None:
        bind_loop(asyncio.get_running_loop())
        try:
            await scenario()
        finally:
            bind_loop(None)

    async_to_sync(on_one_loop)()


emit = database_sync_to_async(Event.objects.emit)


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_socket_without_a_session(memory_layer):
    async def scenario():
        socket = communicator()
        assert await socket.connect() == (False, 4401)
        await socket.disconnect()

    run(scenario)


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_socket_from_another_origin(memory_layer, orgs):
    cookie = session_cookie("alice", orgs[0])

    async def scenario():
        socket = communicator(cookie, origin="http://evil.example")
        connected, _ = await socket.connect()
        assert not connected
        await socket.disconnect()
        # The same session from the console's own origin is let in.
        socket = communicator(cookie)
        connected, _ = await socket.connect()
        assert connected
        await socket.disconnect()

    run(scenario)


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_user_in_no_org(memory_layer):
    cookie = session_cookie("loner", None)

    async def scenario():
        socket = communicator(cookie)
        assert await socket.connect() == (False, 4403)
        await socket.disconnect()

    run(scenario)


@pytest.mark.django_db(transaction=True)
def test_it_delivers_the_orgs_events_and_never_another_orgs(memory_layer, orgs):
    acme, globex = orgs
    alice, bob = session_cookie("alice", acme), session_cookie("bob", globex)

    async def scenario():
        sockets = {"alice": communicator(alice), "bob": communicator(bob)}
        for socket in sockets.values():
            assert (await socket.connect())[0]
        # Globex's event first: had it leaked, it would be the first frame Alice reads.
        theirs = await emit(globex, "job.queued", {"id": "job_globex", "status": "queued"})
        ours = await emit(acme, "job.completed", {"id": "job_acme", "status": "completed"})

        frame = await sockets["alice"].receive_json_from(timeout=2)
        assert frame == {
            "id": ours.id,
            "object": "event",
            "type": "job.completed",
            "created": int(ours.created.timestamp()),
            "data": {"id": "job_acme", "status": "completed"},
        }
        assert await sockets["alice"].receive_nothing(timeout=0.3)
        assert (await sockets["bob"].receive_json_from(timeout=2))["id"] == theirs.id
        assert await sockets["bob"].receive_nothing(timeout=0.3)
        for socket in sockets.values():
            await socket.disconnect()

    run(scenario)


@pytest.mark.django_db(transaction=True)
def test_it_pushes_an_event_only_once_its_transaction_commits(memory_layer, orgs):
    from django.db import transaction

    acme, _ = orgs
    cookie = session_cookie("alice", acme)

    @database_sync_to_async
    def emit_then_roll_back() -> None:
        with transaction.atomic():
            Event.objects.emit(acme, "job.queued", {"id": "job_never"})
            transaction.set_rollback(True)

    async def scenario():
        socket = communicator(cookie)
        assert (await socket.connect())[0]
        await emit_then_roll_back()
        assert await socket.receive_nothing(timeout=0.3)
        kept = await emit(acme, "job.queued", {"id": "job_kept"})
        assert (await socket.receive_json_from(timeout=2))["id"] == kept.id
        await socket.disconnect()

    run(scenario)

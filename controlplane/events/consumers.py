"""`/ws/events`: the console's live event stream.

The socket authenticates by the console's session (AuthMiddlewareStack), its origin is checked
against ALLOWED_HOSTS (AllowedHostsOriginValidator in asgi.py), and it joins only the group of
the org its user belongs to, so it only ever sees that org's events.

A reconnecting console passes `?after=evt_…` (the last event it got) and first receives every
event of its org after that one, then live ones, each once: the socket reads the log through an
`EventCursor`, as `GET /v1/events` does (see `controlplane/events/stream.py` for why). An
`after` that is not an event of the user's org closes the socket with 4400.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.accounts.models import Membership
from controlplane.events.push import org_group
from controlplane.events.stream import EventCursor, UnknownEvent


@database_sync_to_async
def _org_id_of(user) -> int | None:
    membership = Membership.objects.filter(user=user).order_by("created").first()
    return membership.org_id if membership else None


class EventsConsumer(AsyncJsonWebsocketConsumer):
    """Sends the org's events as JSON frames `{id, object, type, created, data}`, read from the
    log when a push announces them."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        self.group = None
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        org_id = await _org_id_of(user)
        if org_id is None:
            await self.close(code=4403)
            return
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        after = (query.get("after") or [""])[-1] or None
        try:
            cursor = None if after is None else await EventCursor.after(org_id, after)
        except UnknownEvent:
            await self.close(code=4400)
            return
        # Join before the cursor's first read of events, so none falls between it and the pushes.
        self.group = org_group(org_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        self.cursor = cursor or await EventCursor.at_end(org_id)
        await self.accept()
        await self._send_new()

    async def disconnect(self, code: int) -> None:
        if self.group is not None:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content, **kwargs) -> None:
        # The stream is one-way; anything the browser sends is ignored.
        return

    async def event_message(self, message: dict) -> None:
        # Channels runs a consumer's handlers one at a time, so reads never interleave.
        if self.cursor.is_news(message):
            await self._send_new()

    async def _send_new(self) -> None:
        async for event in self.cursor.read():
            await self.send_json(event)

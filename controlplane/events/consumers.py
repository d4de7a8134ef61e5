"""`/ws/events`: the console's live event stream.

The socket authenticates by the console's session (AuthMiddlewareStack), its origin is checked
against ALLOWED_HOSTS (AllowedHostsOriginValidator in asgi.py), and it joins only the group of
the org its user belongs to, so it only ever sees that org's events.
"""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.accounts.models import Membership
from controlplane.events.push import org_group


@database_sync_to_async
def _org_id_of(user) -> int | None:
    membership = Membership.objects.filter(user=user).order_by("created").first()
    return membership.org_id if membership else None


class EventsConsumer(AsyncJsonWebsocketConsumer):
    """Forwards the org's event pushes as JSON frames `{id, object, type, created, data}`."""

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
        self.group = org_group(org_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if self.group is not None:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content, **kwargs) -> None:
        # The stream is one-way; anything the browser sends is ignored.
        return

    async def event_message(self, message: dict) -> None:
        await self.send_json(message["event"])

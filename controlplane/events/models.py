"""The durable event log: every state change of an org's objects is a row first, a push second.

A push over the channel layer is at most once (Channels drops messages for a channel over
capacity), so a client that missed one reads the rows back; the push only saves it the wait.
"""

from __future__ import annotations

import secrets
from typing import Any

from django.db import models, transaction

from controlplane.events.push import push_to_org


def new_event_id() -> str:
    return f"evt_{secrets.token_hex(12)}"


class EventManager(models.Manager["Event"]):
    def emit(self, org, type: str, data: dict[str, Any]) -> Event:
        """Write the event, and push it to the org's live listeners once the row is committed
        (a push for a rolled-back change would announce something that never happened)."""
        event = self.create(org=org, type=type, data=data)
        message = event.as_message()
        transaction.on_commit(lambda: push_to_org(org.pk, message))
        return event


class Event(models.Model):
    """`{id, type, created, data}` as clients see it; `sequence` orders an org's events."""

    sequence = models.BigAutoField(primary_key=True)
    id = models.CharField(max_length=40, unique=True, default=new_event_id)
    org = models.ForeignKey("accounts.Org", on_delete=models.CASCADE, related_name="events")
    type = models.CharField(max_length=64)
    data = models.JSONField()
    created = models.DateTimeField(auto_now_add=True)

    objects = EventManager()

    class Meta:
        indexes = [models.Index(fields=["org", "sequence"], name="event_org_sequence")]

    def as_message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "event",
            "type": self.type,
            "created": int(self.created.timestamp()),
            "data": self.data,
        }

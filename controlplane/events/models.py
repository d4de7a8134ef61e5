"""The durable event log: every state change of an org's objects is a row first, a push second.

A push over the channel layer is at most once (Channels drops messages for a channel over
capacity), so a client that missed one reads the rows back; the push only saves it the wait.
"""

from __future__ import annotations

import secrets
from typing import Any

from django.db import connection, models, transaction

from controlplane.events.push import push_to_org


def new_event_id() -> str:
    return f"evt_{secrets.token_hex(12)}"


# First key of the PostgreSQL advisory locks that order an org's event commits (the second is
# the org's id); an arbitrary constant that no other lock in Hearth uses.
EMIT_LOCK_NAMESPACE = 0x4576


def _lock_org_events(org_pk: int) -> bool:
    """Take the org's event lock (PostgreSQL) and say whether it has an enabled webhook
    endpoint, in one round trip."""
    endpoints = WebhookEndpoint._meta.db_table
    has_endpoint = f"EXISTS (SELECT 1 FROM {endpoints} WHERE org_id = %s AND enabled)"
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                f"SELECT pg_advisory_xact_lock(%s, %s), {has_endpoint}",
                [EMIT_LOCK_NAMESPACE, org_pk, org_pk],
            )
            return bool(cursor.fetchone()[1])
        cursor.execute(f"SELECT {has_endpoint}", [org_pk])
        return bool(cursor.fetchone()[0])


class EventManager(models.Manager["Event"]):
    def emit(self, org, type: str, data: dict[str, Any]) -> Event:
        """Write the event, and push it to the org's live listeners once the row is committed
        (a push for a rolled-back change would announce something that never happened).

        An org's events commit in `sequence` order: on PostgreSQL the insert first takes a
        per-org advisory lock held until commit. Without it two transactions could take
        sequences 10 and 11 and commit 11 first, and a reader resuming "after 11" (the event
        stream's cursor) would never see 10. Emits are the last writes of their transactions, so
        the lock serialises little more than the commits. SQLite has one writer at a time."""
        [event] = self.emit_all([(org, type, data)])
        return event

    def emit_all(self, events: list[tuple[Any, str, dict[str, Any]]]) -> list[Event]:
        """`emit` for several `(org, type, data)` at once (admission's group commit): each org's
        lock once, in org order, and one INSERT for all the rows, in the order given."""
        orgs = {org.pk: org for org, _, _ in events}
        with transaction.atomic(savepoint=False):
            webhooks = {org_pk: _lock_org_events(org_pk) for org_pk in sorted(orgs)}
            rows = self.bulk_create(
                [
                    Event(org=org, type=type, data=data, fan_out_pending=webhooks[org.pk])
                    for org, type, data in events
                ]
            )
        for event in rows:
            _announce_on_commit(event)
        return rows


def _announce_on_commit(event: Event) -> None:
    """Push the event once its row commits; and have the worker fan it out to the org's webhook
    endpoints, if it had any when written."""
    org_pk, message, sequence = event.org_id, event.as_message(), event.sequence
    transaction.on_commit(lambda: push_to_org(org_pk, message, sequence))
    if event.fan_out_pending:
        # The worker creates the deliveries; a broker outage must not fail the caller (the
        # sweep fans out what stays pending: controlplane/events/redelivery.py).
        from controlplane.events.tasks import fan_out_event  # the actors import this module

        transaction.on_commit(lambda: fan_out_event.send(sequence), robust=True)


class Event(models.Model):
    """`{id, type, created, data}` as clients see it; `sequence` orders an org's events."""

    sequence = models.BigAutoField(primary_key=True)
    id = models.CharField(max_length=40, unique=True, default=new_event_id)
    org = models.ForeignKey("accounts.Org", on_delete=models.CASCADE, related_name="events")
    type = models.CharField(max_length=64)
    data = models.JSONField()
    created = models.DateTimeField(auto_now_add=True)
    # The org had a webhook endpoint when it was written, and its deliveries are not created yet.
    fan_out_pending = models.BooleanField(default=False)

    objects = EventManager()

    class Meta:
        indexes = [
            models.Index(fields=["org", "sequence"], name="event_org_sequence"),
            models.Index(
                fields=["created"],
                name="event_fan_out_pending",
                condition=models.Q(fan_out_pending=True),
            ),
        ]

    def as_message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "event",
            "type": self.type,
            "created": int(self.created.timestamp()),
            "data": self.data,
        }


# The webhook models live in webhooks.py; Django registers an app's models from this module.
from controlplane.events.webhooks import WebhookDelivery, WebhookEndpoint  # noqa: E402, F401

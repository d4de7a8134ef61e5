"""The durable event log: every state change of an org's objects is a row first, a push second.

A push over the channel layer is at most once (Channels drops messages for a channel over
capacity), so a client that missed one reads the rows back; the push only saves it the wait.
"""

from __future__ import annotations

import secrets
from functools import partial
from typing import Any

from django.db import connection, models, transaction
from django.utils import timezone

from controlplane import json_rows
from controlplane.broker import send
from controlplane.events.push import push_to_org

# The app's webhook models live in their own module; Django registers them from this one.
from controlplane.events.webhooks import WebhookDelivery, WebhookEndpoint  # noqa: F401
from inference.protocol.messages import CONTROLPLANE_QUEUE

# The worker's actor that creates an event's webhook deliveries (controlplane/events/tasks.py).
FAN_OUT_ACTOR = "fan_out_event"


def new_event_id() -> str:
    return f"evt_{secrets.token_hex(12)}"


# First key of the PostgreSQL advisory locks that order an org's event commits (the second is
# the org's id); an arbitrary constant that no other lock in Hearth uses.
EMIT_LOCK_NAMESPACE = 0x4576


def _has_enabled_endpoint(org_pk: int) -> bool:
    """Whether the org has an enabled webhook endpoint (SQLite; on PostgreSQL the events'
    INSERT reads it)."""
    endpoints = WebhookEndpoint._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT EXISTS (SELECT 1 FROM {endpoints} WHERE org_id = %s AND enabled)", [org_pk]
        )
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

    def emit_all(
        self,
        events: list[tuple[Any, str, dict[str, Any]]],
        first: tuple[str, list[Any]] | None = None,
    ) -> list[Event]:
        """`emit` for several `(org, type, data)` at once: each org's lock once, in org order,
        and one INSERT for all the rows, in the order given. `first`, a statement and its
        parameters, runs before them in the same transaction (the jobs these events announce).

        On PostgreSQL it is all one round trip (the statements sent together; outside a
        transaction they are one of their own), so the org's lock is held from the INSERT to
        the commit without a round trip to the client in between; whether the org has webhook
        endpoints is read in the INSERT."""
        now = timezone.now()
        rows = [Event(org=org, type=type, data=data, created=now) for org, type, data in events]
        if connection.vendor == "postgresql":
            _insert_in_one_round_trip(rows, first)
        else:
            with transaction.atomic(savepoint=False):
                if first is not None:
                    with connection.cursor() as cursor:
                        cursor.execute(*first)
                # One writer at a time: SQLite needs no lock to commit in `sequence` order.
                webhooks = {org: _has_enabled_endpoint(org) for org in {e.org_id for e in rows}}
                for row in rows:
                    row.fan_out_pending = webhooks[row.org_id]
                self.bulk_create(rows)
        _announce_on_commit(rows)
        return rows


def _insert_in_one_round_trip(rows: list[Event], first: tuple[str, list[Any]] | None) -> None:
    """PostgreSQL: `first`, each org's event lock, the events' INSERT … RETURNING, sent as one
    query; the rows get their sequences and `fan_out_pending`. The events travel as one JSON
    document (json_rows.py), so the query's text depends only on how many orgs it locks."""
    endpoints = WebhookEndpoint._meta.db_table
    statements = [first] if first is not None else []
    for org_pk in sorted({row.org_id for row in rows}):
        statements.append(("SELECT pg_advisory_xact_lock(%s, %s)", [EMIT_LOCK_NAMESPACE, org_pk]))
    table = Event._meta.db_table
    fields = [Event._meta.get_field(name) for name in ("id", "org", "type", "data", "created")]
    document = json_rows.document([json_rows.row_values(row, fields) for row in rows])
    statements.append(
        (
            f"INSERT INTO {table} (id, org_id, type, data, created, fan_out_pending) "
            "SELECT r.id, r.org_id, r.type, r.data, r.created, EXISTS (SELECT 1 FROM "
            f"{endpoints} WHERE org_id = r.org_id AND enabled) FROM {json_rows.expand(table)} "
            "ORDER BY r.ordinality RETURNING id, sequence, fan_out_pending",
            [document],
        )
    )
    with connection.cursor() as cursor:
        cursor.execute(
            ";\n".join(sql for sql, _ in statements),
            [value for _, values in statements for value in values],
        )
        while cursor.nextset():  # to the last statement's result: the INSERT's
            pass
        returned = {event_id: (sequence, fan_out) for event_id, sequence, fan_out in cursor}
    for row in rows:
        row.sequence, row.fan_out_pending = returned[row.id]
        row._state.adding, row._state.db = False, connection.alias


def _announce_on_commit(events: list[Event]) -> None:
    """Once the rows commit, push one announcement per org (a group commit's or a start notice's
    events cost one channel-layer send, not one each); and have the worker fan each event out
    to the org's webhook endpoints, if it had any when written."""
    announced: dict[int, tuple[list[str], int]] = {}
    for event in events:
        types, last = announced.get(event.org_id, ([], 0))
        if event.type not in types:
            types.append(event.type)
        announced[event.org_id] = (types, max(last, event.sequence))
    for org_pk, (types, sequence) in announced.items():
        transaction.on_commit(partial(push_to_org, org_pk, types, sequence))
    for event in events:
        if event.fan_out_pending:
            # The worker creates the deliveries; a broker outage must not fail the caller (the
            # sweep fans out what stays pending: controlplane/events/redelivery.py).
            # By the actor's name: the actors' module imports this one.
            fan_out = partial(send, CONTROLPLANE_QUEUE, FAN_OUT_ACTOR, event.sequence)
            transaction.on_commit(fan_out, robust=True)


class Event(models.Model):
    """`{id, type, created, data}` as clients see it; `sequence` orders an org's events."""

    sequence = models.BigAutoField(primary_key=True)
    id = models.CharField(max_length=40, unique=True, default=new_event_id)
    # Not indexed alone: event_org_sequence leads with it.
    org = models.ForeignKey(
        "accounts.Org", on_delete=models.CASCADE, related_name="events", db_index=False
    )
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

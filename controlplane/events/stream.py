"""`GET /v1/events`: the org's event log as a resumable Server-Sent Events stream.

The database is the stream's only source; a push on the org's channel-layer group only says
"there is something new". The stream keeps a cursor, the `sequence` of the last event it read,
and after each push reads the org's events past it, in order. That one rule gives exactly once
with no bookkeeping between a backlog and a live part, because there is none: resuming is the
same read, started from the event the client names.

- No gap: the stream joins the group before it first reads (the backlog, or the cursor's start
  for "only new events"), so an event committed after that read is announced by a push that is
  still waiting. An org's events commit in `sequence` order (`EventManager.emit`), so what a
  read sees is always a whole prefix of the log, and nothing can later appear below the cursor.
  A push is at most once, so a lost one is made good by reading again at every keepalive.
- No duplicate: each read starts past the last event read; a push for an event already read
  (a burst of events is read by the first of its pushes) does not even cost a query.

The alternative, forwarding the pushed events themselves and dropping those the backlog
already sent, would need a repair path for lost pushes and for pushes that arrive out of
`sequence` order (two commits' on-commit hooks race), which is this design again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse

from controlplane import layer_receive
from controlplane.api.auth import ApiKeyPrincipal, authenticate
from controlplane.api.errors import ApiError
from controlplane.events.models import Event
from controlplane.events.push import org_group

# A comment line this often keeps proxies from closing an idle stream; each is also a read of
# the log, which delivers events whose push was lost.
KEEPALIVE_S = 15.0
# Events read from the database per query while catching up.
READ_BATCH = 500


class UnknownEvent(Exception):
    """The event to resume after is not in this org's log (unknown, or another org's)."""


class EventCursor:
    """Where one listener stands in its org's event log: reads the events past it, in order,
    each once, keeping only those of `types` (all when None)."""

    def __init__(self, org_id: int, sequence: int, types: frozenset[str] | None = None) -> None:
        self.org_id, self.sequence, self.types = org_id, sequence, types

    @classmethod
    async def after(
        cls, org_id: int, event_id: str, types: frozenset[str] | None = None
    ) -> EventCursor:
        """A cursor just past event `event_id`; raises UnknownEvent when that is not an event
        of this org (unknown and another org's alike, so nothing tells them apart)."""
        sequence = await sync_to_async(_sequence_of, thread_sensitive=False)(org_id, event_id)
        return cls(org_id, sequence, types)

    @classmethod
    async def at_end(cls, org_id: int, types: frozenset[str] | None = None) -> EventCursor:
        """A cursor past the org's latest event: only new events. Join the org's group first,
        so that no event falls between this read and the first push."""
        sequence = await sync_to_async(_latest_sequence, thread_sensitive=False)(org_id)
        return cls(org_id, sequence, types)

    def is_news(self, push: dict[str, Any]) -> bool:
        """Whether a push on the org's group may announce an event this cursor has not read
        (push_to_org). A push without `sequence` is treated as news."""
        if self.types is not None and self.types.isdisjoint(push.get("types") or ()):
            return False
        sequence = push.get("sequence")
        return sequence is None or sequence > self.sequence

    async def read(self) -> AsyncIterator[dict[str, Any]]:
        """The events committed past the cursor, as `Event.as_message()` dicts, moving the
        cursor over each (skipped types included) as it goes."""
        while True:
            batch = await sync_to_async(_events_after, thread_sensitive=False)(
                self.org_id, self.sequence, READ_BATCH
            )
            for sequence, message in batch:
                self.sequence = sequence
                if self.types is None or message["type"] in self.types:
                    yield message
            if len(batch) < READ_BATCH:
                return


def _sequence_of(org_id: int, event_id: str) -> int:
    try:
        events = Event.objects.filter(org_id=org_id, id=event_id)
        sequence = events.values_list("sequence", flat=True).first()
    finally:
        close_old_connections()  # this is a thread of the shared pool, not a request's
    if sequence is None:
        raise UnknownEvent(event_id)
    return sequence


def _latest_sequence(org_id: int) -> int:
    try:
        latest = Event.objects.filter(org_id=org_id).order_by("-sequence").first()
    finally:
        close_old_connections()
    return latest.sequence if latest else 0


def _events_after(org_id: int, sequence: int, limit: int) -> list[tuple[int, dict[str, Any]]]:
    try:
        events = Event.objects.filter(org_id=org_id, sequence__gt=sequence).order_by("sequence")
        return [(event.sequence, event.as_message()) for event in events[:limit]]
    finally:
        close_old_connections()


def _authenticate(header: str) -> ApiKeyPrincipal:
    try:
        return authenticate(header)
    finally:
        close_old_connections()


def sse_frame(message: dict[str, Any]) -> bytes:
    """One event as SSE: its id (what the client resumes from), its type, and the event."""
    data = json.dumps(message, separators=(",", ":"))
    return f"id: {message['id']}\nevent: {message['type']}\ndata: {data}\n\n".encode()


KEEPALIVE_FRAME = b": keepalive\n\n"


async def events(request: HttpRequest) -> HttpResponse:
    """`GET /v1/events[?after=evt_…][&types=a,b]`, or with `Last-Event-ID`: the key's org's
    events after that one, then live ones, until the client goes. `Last-Event-ID` wins over
    `after`: a browser's EventSource reconnects to the same URL with the header set to the
    last event it got."""
    if request.method != "GET":
        return ApiError(405, "Use GET for /v1/events.", code="method_not_allowed").response()
    try:
        principal = await sync_to_async(_authenticate, thread_sensitive=False)(
            request.headers.get("Authorization", "")
        )
    except ApiError as error:
        return error.response()
    after = request.headers.get("Last-Event-ID") or request.GET.get("after") or None
    names = [name.strip() for name in request.GET.get("types", "").split(",")]
    types = frozenset(name for name in names if name) or None
    cursor = None
    if after is not None:
        try:
            cursor = await EventCursor.after(principal.org.pk, after, types)
        except UnknownEvent:
            return ApiError(
                400,
                f"No event {after!r} in this organization's event log to resume after.",
                param="after",
                code="unknown_event",
            ).response()
    response = StreamingHttpResponse(
        _stream(principal.org.pk, types, cursor), content_type="text/event-stream"
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


async def _stream(
    org_id: int, types: frozenset[str] | None, cursor: EventCursor | None
) -> AsyncIterator[bytes]:
    """Join the org's group, then read, wait for a push or the keepalive, read again. A
    client's disconnect cancels it (CancelledError) at one of its awaits; it leaves the group on
    the way out. (It joins here, not in the view, so that a stream never started joins nothing.)
    `cursor` is None for only new events."""
    layer = get_channel_layer()
    group = org_group(org_id)
    channel = await layer.new_channel()
    loop = asyncio.get_running_loop()
    await layer.group_add(group, channel)
    try:
        if cursor is None:
            cursor = await EventCursor.at_end(org_id, types)
        while True:
            async for message in cursor.read():
                yield sse_frame(message)
            deadline = loop.time() + KEEPALIVE_S
            while True:
                try:
                    push = await layer_receive.receive(
                        layer, channel, max(0.0, deadline - loop.time())
                    )
                except TimeoutError:
                    yield KEEPALIVE_FRAME
                    break
                if cursor.is_news(push):
                    break
    finally:
        await layer.group_discard(group, channel)

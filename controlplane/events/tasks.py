"""Webhook actors: an event's fan-out to its org's endpoints, and each delivery attempt.

Both are safe to run twice for the same message (Dramatiq delivers at least once): the fan-out
creates each first attempt once (unique row), and an attempt is sent only by the run that
claims it (`WebhookDeliveryManager.claim`).
"""

from __future__ import annotations

import dramatiq
from django.utils import timezone

from controlplane.events.models import FAN_OUT_ACTOR
from controlplane.events.webhooks import WebhookDelivery
from inference.protocol.messages import CONTROLPLANE_QUEUE


@dramatiq.actor(actor_name=FAN_OUT_ACTOR, queue_name=CONTROLPLANE_QUEUE)
def fan_out_event(event_pk: int) -> None:
    """`Event.objects.emit` sends this once the event is committed: one first attempt per
    matching endpoint, each enqueued for delivery."""
    for delivery_id in WebhookDelivery.objects.fan_out(event_pk):
        deliver_webhook.send(delivery_id)


@dramatiq.actor(actor_name="deliver_webhook", queue_name=CONTROLPLANE_QUEUE)
def deliver_webhook(delivery_id: str) -> None:
    """Send one attempt; a failed one enqueues the next with Dramatiq's `delay`."""
    delivery = WebhookDelivery.objects.claim(delivery_id)
    if delivery is None:
        return
    retry = delivery.send()
    if retry is not None:
        delay_ms = max(0, round((retry.scheduled_at - timezone.now()).total_seconds() * 1000))
        deliver_webhook.send_with_options(args=(retry.pk,), delay=delay_ms or None)

"""Webhook work lost with the broker, sent again from the database.

A fan-out message and each attempt's message live only in the broker (a retry waits there as a
delayed message). A Redis restarted without persistence drops them; the rows say what is owed:
an event still `fan_out_pending` some time after it was written has no deliveries yet, and an
attempt still pending after it was due (or `sending` past its claim's lease) was never sent.
`resend_lost_webhooks` fans out the first and enqueues the second again. Sending twice is
harmless: the fan-out creates each first attempt once, and an attempt is sent only by whoever
claims it. A resent attempt's `scheduled_at` moves to now, so a backlog in a healthy broker gets
at most one extra message per attempt per grace period.

Run by `manage.py sweepjobs` with the job sweep (controlplane/dispatch/redelivery.py).
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from controlplane.events.models import Event
from controlplane.events.tasks import deliver_webhook
from controlplane.events.webhooks import WebhookDelivery

BATCH = 500


def resend_lost_webhooks(grace_s: float) -> int:
    """Fan out events and enqueue attempts left behind for longer than `grace_s`; how many
    messages went out."""
    now = timezone.now()
    cutoff = now - timedelta(seconds=grace_s)
    sent = 0
    for event_pk in Event.objects.filter(fan_out_pending=True, created__lt=cutoff).values_list(
        "pk", flat=True
    )[:BATCH]:
        for delivery_id in WebhookDelivery.objects.fan_out(event_pk):
            deliver_webhook.send(delivery_id)
            sent += 1
    lease_cutoff = now - timedelta(
        seconds=settings.WEBHOOK_TIMEOUT_S + settings.WEBHOOK_CLAIM_LEASE_MARGIN_S
    )
    overdue = WebhookDelivery.objects.filter(
        Q(status=WebhookDelivery.PENDING, scheduled_at__lt=cutoff)
        | Q(status=WebhookDelivery.SENDING, claimed_at__lt=lease_cutoff)
    )
    for delivery in overdue.only("pk", "scheduled_at")[:BATCH]:
        # One sweep per attempt per grace period: the next round sees it as due now.
        moved = WebhookDelivery.objects.filter(
            pk=delivery.pk, scheduled_at=delivery.scheduled_at
        ).update(scheduled_at=now)
        if moved:
            deliver_webhook.send(delivery.pk)
            sent += 1
    return sent

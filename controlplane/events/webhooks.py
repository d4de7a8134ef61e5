"""Webhooks: an org's endpoints, and every delivery attempt of its events to them.

Deliveries follow the Standard Webhooks spec (standardwebhooks.com): the body is the event as
the API shows it (`Event.as_message()`), signed with the endpoint's secret by the spec's own
`standardwebhooks` library; `webhook-id` is the event's id, the same on every retry, so a
receiver can drop duplicates.

Each attempt is a `WebhookDelivery` row, unique on (endpoint, event, attempt): the fan-out of an
event creates attempt 1 per matching endpoint, and a failed attempt creates the next one. A row
is sent only by whoever claims it with a conditional UPDATE (pending → sending), so Dramatiq's
at-least-once delivery of the same message never sends an attempt twice at the same time.

An endpoint must be public: a URL whose host resolves to a private, loopback, link-local,
multicast, reserved or unspecified address is refused (the control plane must not become a way
into the network it runs in), at registration and again at every attempt, when the request is
sent to the very address that was checked (DNS can change in between, or answer differently to
the second lookup). `WEBHOOK_ALLOW_PRIVATE` lifts the rule (a laptop, a private deployment).
"""

from __future__ import annotations

import base64
import http.client
import ipaddress
import json
import logging
import random
import secrets
import socket
import time
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone
from standardwebhooks.webhooks import Webhook

from controlplane.api.responses import epoch_seconds

logger = logging.getLogger(__name__)

# The event types an endpoint may subscribe to: those the control plane emits.
EVENT_TYPES = (
    "job.queued",
    "job.running",
    "job.completed",
    "job.failed",
    "job.cancelled",
    "job.expired",
    "batch.in_progress",
    "batch.completed",
    "batch.failed",
    "batch.expired",
    "batch.cancelled",
)
# How much of a receiver's answer is kept in the delivery log.
RESPONSE_EXCERPT_BYTES = 1024


def new_endpoint_id() -> str:
    return f"we_{secrets.token_hex(12)}"


def new_delivery_id() -> str:
    return f"whd_{secrets.token_hex(12)}"


def new_secret() -> str:
    """`whsec_` and the base64 of 24 random bytes, the key format of Standard Webhooks."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


class UrlRejected(ValueError):
    """The URL is not one webhooks may be sent to; `code` says why."""

    def __init__(self, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.code = code


def _is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        # Also the shared address space of carrier NAT (100.64.0.0/10), which is not "private".
        or not address.is_global
    )


def check_url(url: str) -> list[str]:
    """The addresses `url`'s host resolves to, in resolver order, when webhooks may be sent there;
    raises UrlRejected otherwise. Every address must be public (unless WEBHOOK_ALLOW_PRIVATE):
    a host with one private address among public ones is refused."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise UrlRejected(f"'url' is not a valid URL: {exc}.") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UrlRejected("'url' must be an http:// or https:// URL with a host.")
    if parts.username is not None or parts.password is not None:
        raise UrlRejected("'url' must not carry credentials.")
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise UrlRejected(f"The host of 'url' could not be resolved ({exc}).") from exc
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not settings.WEBHOOK_ALLOW_PRIVATE:
        for address in addresses:
            if not _is_public(ipaddress.ip_address(address.split("%", 1)[0])):
                raise UrlRejected(
                    f"'url' resolves to {address}, which is not a public address.",
                    code="url_not_allowed",
                )
    return addresses


def post_pinned(
    url: str, addresses: list[str], body: bytes, headers: dict[str, str], timeout: float
) -> tuple[int, str]:
    """POST `body` to `url`, connecting only to `addresses` (those `check_url` approved, tried in
    order) while the Host header and TLS certificate check use the URL's host name. Redirects are
    not followed: a 3xx is the receiver's answer. Returns the status and the start of the body."""
    parts = urlsplit(url)
    connection_class = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    connection = connection_class(parts.hostname, parts.port, timeout=timeout)

    def connect_pinned(address, timeout=timeout, source_address=None):
        # http.client's hook for opening the socket: the host name never reaches a resolver.
        error: OSError | None = None
        for candidate in addresses:
            try:
                return socket.create_connection((candidate, address[1]), timeout, source_address)
            except OSError as exc:
                error = exc
        raise error or OSError("no address to connect to")

    connection._create_connection = connect_pinned
    try:
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        connection.request("POST", target, body=body, headers=headers)
        response = connection.getresponse()
        excerpt = response.read(RESPONSE_EXCERPT_BYTES).decode("utf-8", errors="replace")
        return response.status, excerpt
    finally:
        connection.close()


def retry_delay_s(failed_attempt: int) -> float:
    """Seconds before the attempt after `failed_attempt` (1-based): full jitter, uniform between
    0 and the schedule's step for it (the last step repeats), so endpoints that failed together
    do not retry together."""
    schedule = settings.WEBHOOK_RETRY_SCHEDULE_S
    step = schedule[min(failed_attempt, len(schedule)) - 1]
    return random.uniform(0, step)


class WebhookEndpointManager(models.Manager["WebhookEndpoint"]):
    def register(
        self, org, url: str, event_types: list[str] | None = None, description: str = ""
    ) -> WebhookEndpoint:
        """A new enabled endpoint with a fresh secret; raises UrlRejected for a URL it may not
        call. `event_types` empty or None: every event."""
        check_url(url)
        return self.create(
            org=org, url=url, event_types=list(event_types or []), description=description
        )


class WebhookEndpoint(models.Model):
    """Where an org's events are POSTed. The secret is a signing key, kept as it is (a hash
    could not sign); the API shows it only when it is created or rotated."""

    id = models.CharField(primary_key=True, max_length=40, default=new_endpoint_id)
    org = models.ForeignKey(
        "accounts.Org", on_delete=models.CASCADE, related_name="webhook_endpoints"
    )
    url = models.CharField(max_length=2048)
    event_types = models.JSONField(default=list, blank=True)
    secret = models.CharField(max_length=64, default=new_secret)
    description = models.CharField(max_length=512, blank=True, default="")
    enabled = models.BooleanField(default=True)
    disabled_reason = models.CharField(max_length=255, blank=True, default="")
    created = models.DateTimeField(auto_now_add=True)

    objects = WebhookEndpointManager()

    class Meta:
        app_label = "events"
        indexes = [models.Index(fields=["org", "created"], name="webhook_endpoint_org_created")]

    def wants(self, event_type: str) -> bool:
        return not self.event_types or event_type in self.event_types

    def rotate_secret(self) -> str:
        """Replace the secret at once: deliveries signed from now on verify only with the new
        one (an attempt already in flight was signed with the old)."""
        self.secret = new_secret()
        self.save(update_fields=["secret"])
        return self.secret

    def disable(self, reason: str) -> bool:
        """Stop delivering to this endpoint; True when this call disabled it."""
        changed = WebhookEndpoint.objects.filter(pk=self.pk, enabled=True).update(
            enabled=False, disabled_reason=reason
        )
        self.enabled, self.disabled_reason = False, reason
        return bool(changed)

    def enable(self) -> bool:
        """Deliver to this endpoint again (events written while it was disabled are not sent);
        True when this call enabled it."""
        changed = WebhookEndpoint.objects.filter(pk=self.pk, enabled=False).update(
            enabled=True, disabled_reason=""
        )
        self.enabled, self.disabled_reason = True, ""
        return bool(changed)


class WebhookDeliveryManager(models.Manager["WebhookDelivery"]):
    def fan_out(self, event_pk: int) -> list[str]:
        """Create the first attempt for each of the event's org's enabled endpoints that wants
        its type, and return the ids of the first attempts still pending. Run again for the same
        event (a redelivered message) it creates nothing and returns the attempts not yet sent,
        which is what a run that died before enqueueing them left behind."""
        # Event, through the delivery's key to it: its module imports this one.
        events = self.model._meta.get_field("event").related_model.objects
        event = events.filter(pk=event_pk).first()
        if event is None:
            return []
        # An endpoint gets the events written after it was created, not the org's history.
        endpoints = WebhookEndpoint.objects.filter(
            org_id=event.org_id, enabled=True, created__lte=event.created
        )
        pending = []
        for endpoint in endpoints:
            if not endpoint.wants(event.type):
                continue
            delivery, _ = self.get_or_create(
                endpoint=endpoint,
                event=event,
                attempt=1,
                defaults={"scheduled_at": timezone.now()},
            )
            if delivery.status == WebhookDelivery.PENDING:
                pending.append(delivery.pk)
        if event.fan_out_pending:
            events.filter(pk=event.pk).update(fan_out_pending=False)
        return pending

    def claim(self, delivery_id: str) -> WebhookDelivery | None:
        """Take the attempt for sending: pending → sending, for one caller only (a `sending` one
        whose worker died is taken over after its lease). None when someone else has it or it
        is settled."""
        now = timezone.now()
        lease = timedelta(
            seconds=settings.WEBHOOK_TIMEOUT_S + settings.WEBHOOK_CLAIM_LEASE_MARGIN_S
        )
        claimed = (
            self.filter(pk=delivery_id)
            .filter(
                models.Q(status=WebhookDelivery.PENDING)
                | models.Q(status=WebhookDelivery.SENDING, claimed_at__lt=now - lease)
            )
            .update(status=WebhookDelivery.SENDING, claimed_at=now)
        )
        if not claimed:
            return None
        return self.select_related("endpoint", "event").get(pk=delivery_id)

    def retry(self, failed: WebhookDelivery) -> WebhookDelivery | None:
        """Send a failed attempt's event to its endpoint again now, on a person's request (the
        console's Retry): the attempt that follows it when one is waiting (brought forward), else
        a new one after the last. Returns that attempt for the caller to enqueue, or None when
        there is nothing to retry: the attempt did not fail, or a later one is being sent or
        succeeded. A manual attempt past WEBHOOK_MAX_ATTEMPTS is sent once, without automatic
        retries after it. The failed attempt's `next_attempt_at` becomes now: one follows."""
        if failed.status != WebhookDelivery.FAILED:
            return None
        now = timezone.now()
        chain = self.filter(endpoint_id=failed.endpoint_id, event_id=failed.event_id)
        with transaction.atomic():
            last = chain.order_by("-attempt").first()
            if last.status == WebhookDelivery.PENDING:
                # Conditional: a worker that claimed it meanwhile is already sending it.
                if not chain.filter(pk=last.pk, status=WebhookDelivery.PENDING).update(
                    scheduled_at=now
                ):
                    return None
                last.scheduled_at, retry = now, last
            elif last.status == WebhookDelivery.FAILED:
                # get_or_create: two people retrying at once make one attempt.
                retry, _ = self.get_or_create(
                    endpoint_id=failed.endpoint_id,
                    event_id=failed.event_id,
                    attempt=last.attempt + 1,
                    defaults={"scheduled_at": now},
                )
            else:
                return None
            chain.filter(attempt=retry.attempt - 1).update(next_attempt_at=now)
        return retry


class WebhookDelivery(models.Model):
    """One attempt to deliver one event to one endpoint, and what came of it."""

    PENDING, SENDING, SUCCEEDED, FAILED = "pending", "sending", "succeeded", "failed"
    STATUSES = [(s, s) for s in (PENDING, SENDING, SUCCEEDED, FAILED)]

    id = models.CharField(primary_key=True, max_length=40, default=new_delivery_id)
    endpoint = models.ForeignKey(
        WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries"
    )
    event = models.ForeignKey(
        "events.Event", on_delete=models.CASCADE, related_name="webhook_deliveries"
    )
    attempt = models.PositiveSmallIntegerField()
    status = models.CharField(max_length=16, choices=STATUSES, default=PENDING)
    response_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    response_body = models.TextField(blank=True, default="")
    error = models.TextField(blank=True, default="")
    duration_ms = models.PositiveIntegerField(null=True, blank=True)
    created = models.DateTimeField(auto_now_add=True)
    # When this attempt is due; when it was taken for sending.
    scheduled_at = models.DateTimeField()
    claimed_at = models.DateTimeField(null=True, blank=True)
    # On a failed attempt: when the next one is due (null: none will follow).
    next_attempt_at = models.DateTimeField(null=True, blank=True)

    objects = WebhookDeliveryManager()

    class Meta:
        app_label = "events"
        constraints = [
            models.UniqueConstraint(
                fields=["endpoint", "event", "attempt"], name="webhook_delivery_once_per_attempt"
            )
        ]
        indexes = [
            models.Index(fields=["endpoint", "-created"], name="webhook_delivery_endpoint"),
            # The sweep's overdue attempts (controlplane/events/redelivery.py).
            models.Index(
                fields=["scheduled_at"],
                name="webhook_delivery_open",
                condition=models.Q(status__in=["pending", "sending"]),
            ),
        ]

    def send(self) -> WebhookDelivery | None:
        """Send this claimed attempt, record the outcome, and return the next attempt when one
        is scheduled (the caller enqueues it for its `scheduled_at`).

        2xx: succeeded. 410 Gone: the receiver asks for no more, so the endpoint is disabled.
        Anything else (another status, a timeout, a refused connection, a URL that now resolves
        to a private address, where nothing is sent) fails this attempt and schedules the next,
        up to WEBHOOK_MAX_ATTEMPTS."""
        endpoint = self.endpoint
        if not endpoint.enabled:
            self._settle(self.FAILED, error=f"endpoint disabled: {endpoint.disabled_reason}")
            return None
        body = json.dumps(self.event.as_message(), separators=(",", ":")).encode()
        timestamp = int(time.time())
        signature = Webhook(endpoint.secret).sign(
            self.event.id, datetime.fromtimestamp(timestamp, UTC), body
        )
        headers = {
            "content-type": "application/json",
            "user-agent": "Hearth-Webhooks/1",
            "webhook-id": self.event.id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature,
        }
        timeout = settings.WEBHOOK_TIMEOUT_S
        status_code, excerpt, error = None, "", ""
        started = time.monotonic()
        try:
            addresses = check_url(endpoint.url)
            status_code, excerpt = post_pinned(endpoint.url, addresses, body, headers, timeout)
        except UrlRejected as exc:
            error = f"{exc.code}: {exc} No request was sent."
        except TimeoutError:
            error = f"timed out after {timeout:g} s"
        except (OSError, http.client.HTTPException) as exc:
            error = f"connection failed: {exc.__class__.__name__}: {exc}"
        duration_ms = round((time.monotonic() - started) * 1000)
        outcome = {
            "response_status_code": status_code,
            "response_body": excerpt,
            "duration_ms": duration_ms,
        }
        if status_code is not None and 200 <= status_code < 300:
            self._settle(self.SUCCEEDED, **outcome)
            return None
        if status_code == 410:
            endpoint.disable(f"the endpoint answered 410 Gone on {timezone.now():%Y-%m-%d %H:%M}Z")
            self._settle(self.FAILED, error="410 Gone: endpoint disabled", **outcome)
            return None
        error = error or f"the endpoint answered {status_code}"
        logger.info(
            "webhook %s attempt %d to %s failed: %s", self.pk, self.attempt, endpoint.pk, error
        )
        if self.attempt >= settings.WEBHOOK_MAX_ATTEMPTS:
            self._settle(self.FAILED, error=error, **outcome)
            return None
        due = timezone.now() + timedelta(seconds=retry_delay_s(self.attempt))
        with transaction.atomic():
            self._settle(self.FAILED, error=error, next_attempt_at=due, **outcome)
            retry, _ = WebhookDelivery.objects.get_or_create(
                endpoint=endpoint,
                event=self.event,
                attempt=self.attempt + 1,
                defaults={"scheduled_at": due},
            )
        return retry

    def _settle(self, status: str, **fields: Any) -> None:
        fields["status"] = status
        for name, value in fields.items():
            setattr(self, name, value)
        WebhookDelivery.objects.filter(pk=self.pk).update(**fields)


def endpoint_object(endpoint: WebhookEndpoint, with_secret: bool = False) -> dict[str, Any]:
    """The endpoint as the API shows it; the secret only when just created or rotated."""
    body: dict[str, Any] = {
        "id": endpoint.id,
        "object": "webhook_endpoint",
        "url": endpoint.url,
        "event_types": endpoint.event_types,
        "description": endpoint.description,
        "enabled": endpoint.enabled,
        "disabled_reason": endpoint.disabled_reason or None,
        "created": epoch_seconds(endpoint.created),
    }
    if with_secret:
        body["secret"] = endpoint.secret
    return body


def delivery_object(delivery: WebhookDelivery) -> dict[str, Any]:
    return {
        "id": delivery.id,
        "object": "webhook_delivery",
        "endpoint_id": delivery.endpoint_id,
        "event_id": delivery.event.id,
        "event_type": delivery.event.type,
        "attempt": delivery.attempt,
        "status": delivery.status,
        "response_status_code": delivery.response_status_code,
        "response_body": delivery.response_body,
        "error": delivery.error or None,
        "duration_ms": delivery.duration_ms,
        "created": epoch_seconds(delivery.created),
        "scheduled_at": epoch_seconds(delivery.scheduled_at),
        "next_attempt_at": epoch_seconds(delivery.next_attempt_at),
    }

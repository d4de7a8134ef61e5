"""Idempotency keys: the `Idempotency-Key` header of a POST, as Stripe defines it.

A key is claimed by inserting its row (org, key) in state `in_flight` before the request runs; the
unique constraint makes the claim atomic, so of two requests racing with one key exactly one runs.
When the request finishes, its row keeps the response for replay (`completed`) or is deleted so a
retry may run (`settle` says which). The decorator that drives this is `gateway.idempotency`.

Also the count of API errors each org was answered, per minute, status and code (`ApiErrorCount`),
for the console's dashboard.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import DatabaseError, IntegrityError, connection, models, transaction
from django.db.models import Q
from django.dispatch import receiver
from django.utils import timezone

from controlplane.api.errors import error_answered

logger = logging.getLogger(__name__)

# Stripe keeps keys 24 hours; after that the key may name a new request.
KEY_TTL = timedelta(hours=24)
# Responses not kept for replay: 401 (no org was known), 409 and 429 (transient: the same request
# may succeed when retried). Every 5xx is also released, so a retry can run.
RELEASED_STATUSES = frozenset({401, 409, 429})


def in_flight_lease() -> timedelta:
    """How long an `in_flight` claim holds its key. A synchronous request answers within
    SYNC_REQUEST_TIMEOUT_S (504 after it), so a claim older than that plus a margin belongs to a
    process that died mid-request; without a lease its key would be locked for 24 hours."""
    return timedelta(seconds=settings.SYNC_REQUEST_TIMEOUT_S + 60)


class IdempotencyKeyManager(models.Manager["IdempotencyKey"]):
    def claim(
        self, org, key: str, fingerprint: str, method: str, path: str
    ) -> tuple[IdempotencyKey, bool]:
        """(row, True) when this request now holds the key and should run; (existing row, False)
        when another request holds it or has completed with it: the caller compares fingerprints
        and states. An expired row, or an `in_flight` one past its lease, is taken over."""
        for _ in range(3):
            now = timezone.now()
            fresh = {
                "fingerprint": fingerprint,
                "method": method,
                "path": path,
                "state": IdempotencyKey.IN_FLIGHT,
                "response_status": None,
                "response_headers": {},
                "response_body": None,
                "created": now,
                "expires_at": now + KEY_TTL,
            }
            try:
                # get_or_create inserts in a savepoint and, when a concurrent insert wins the
                # unique (org, key) constraint, reads the winner's row instead.
                row, created = self.get_or_create(org=org, key=key, defaults=fresh)
            except IntegrityError:
                continue  # the winner's row was deleted (released) before we could read it
            if created:
                return row, True
            stale = Q(expires_at__lte=now) | Q(
                state=IdempotencyKey.IN_FLIGHT, created__lte=now - in_flight_lease()
            )
            # A conditional UPDATE, so of two requests taking over one stale row only one does.
            if self.filter(stale, pk=row.pk).update(**fresh):
                for field, value in fresh.items():
                    setattr(row, field, value)
                return row, True
            return row, False
        raise IntegrityError(f"idempotency key {key!r} kept changing hands; giving up")

    def purge_expired(self) -> int:
        """Delete the keys past their 24 hours; returns how many."""
        deleted, _ = self.filter(expires_at__lte=timezone.now()).delete()
        return deleted


class IdempotencyKey(models.Model):
    """One org's use of one `Idempotency-Key`: the request it named and, once completed, the
    response to replay. `response_body` is null for a completed streamed response, which cannot
    be replayed."""

    IN_FLIGHT, COMPLETED = "in_flight", "completed"
    STATES = [(IN_FLIGHT, "in flight"), (COMPLETED, "completed")]

    org = models.ForeignKey("accounts.Org", on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255)
    # SHA-256 of method, path and the canonical body (see gateway.idempotency.request_fingerprint).
    fingerprint = models.CharField(max_length=64)
    method = models.CharField(max_length=10)
    path = models.CharField(max_length=255)
    state = models.CharField(max_length=16, choices=STATES, default=IN_FLIGHT)
    response_status = models.PositiveSmallIntegerField(null=True)
    response_headers = models.JSONField(default=dict)
    response_body = models.BinaryField(null=True)
    # When the current claim was taken: it also tells a claim from a later one on the same row.
    created = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(db_index=True)

    objects = IdempotencyKeyManager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["org", "key"], name="idempotency_org_key")]

    def __str__(self) -> str:
        return f"{self.key} ({self.state})"

    @property
    def replayable(self) -> bool:
        return self.state == self.COMPLETED and self.response_body is not None

    def settle(self, status: int, headers: dict[str, str], body: bytes | None) -> None:
        """Keep the response for replay, or release the key (401, 409, 429 and 5xx) so a retry
        runs. `body` None records a completed response that cannot be replayed (a stream)."""
        if status in RELEASED_STATUSES or status >= 500:
            self.release()
            return
        self._this_claim().update(
            state=self.COMPLETED,
            response_status=status,
            response_headers=headers,
            response_body=body,
        )

    def release(self) -> None:
        """Give the key up, so the next request with it runs."""
        self._this_claim().delete()

    def _this_claim(self) -> models.QuerySet[IdempotencyKey]:
        # Only this claim: after a lease lapsed and another request took the row over, a late
        # finish of the first request must neither overwrite nor free the second's claim.
        return IdempotencyKey.objects.filter(pk=self.pk, state=self.IN_FLIGHT, created=self.created)


class ApiErrorCountManager(models.Manager["ApiErrorCount"]):
    def add(self, org_id: int, status: int, code: str | None, at: datetime | None = None) -> None:
        """Count one error answered to the org: one upsert of its minute's row, atomic on both
        databases (INSERT … ON CONFLICT DO UPDATE), so concurrent gateways lose no count.
        Best effort: a database that refuses the write is logged, and the error still goes out."""
        minute = (at or timezone.now()).replace(second=0, microsecond=0)
        table = self.model._meta.db_table
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(
                    f"INSERT INTO {table} (org_id, minute, status, code, count) "
                    "VALUES (%s, %s, %s, %s, 1) ON CONFLICT (org_id, minute, status, code) "
                    f"DO UPDATE SET count = {table}.count + 1",
                    [
                        org_id,
                        connection.ops.adapt_datetimefield_value(minute),
                        status,
                        (code or "")[: ApiErrorCount.CODE_LENGTH],
                    ],
                )
        except DatabaseError:
            logger.warning("could not count API error %s %s of org %s", status, code, org_id)


class ApiErrorCount(models.Model):
    """How many error responses (4xx and 5xx in OpenAI's shape) an org's authenticated requests
    got in one UTC minute, with one status and error code. A refusal before any job existed (a
    bad request, a rate limit, a spent budget) leaves no other trace; the dashboard shows these
    beside the failed jobs. A minute's row per code: the dashboard's last hour is exact to the
    minute, and a steady error costs at most 1,440 rows a day."""

    CODE_LENGTH = 64

    # Indexed as the unique constraint's first column.
    org = models.ForeignKey(
        "accounts.Org", on_delete=models.CASCADE, related_name="+", db_index=False
    )
    minute = models.DateTimeField()
    status = models.PositiveSmallIntegerField()
    code = models.CharField(max_length=CODE_LENGTH, blank=True)
    count = models.PositiveIntegerField()

    objects = ApiErrorCountManager()

    class Meta:
        constraints = [
            # The upsert's ON CONFLICT target; it also serves the dashboard (org, then minutes).
            models.UniqueConstraint(
                fields=["org", "minute", "status", "code"], name="one_api_error_count"
            )
        ]


@receiver(error_answered)
def count_api_error(sender, org_id: int, status: int, code: str | None, **kwargs) -> None:
    """Count the errors the API layer answers (its DRF exception handler) to an org."""
    ApiErrorCount.objects.add(org_id, status, code)

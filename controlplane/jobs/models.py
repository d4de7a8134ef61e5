"""Jobs: every completion request, sync or async, is a Job row with a status machine
queued → running → completed | failed (cancelled and expired come with the async API).

State changes are conditional UPDATEs or row-locked transactions, so a result delivered twice
(Dramatiq delivers at least once) settles the job and writes its usage row exactly once.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from django.db import models, transaction
from django.utils import timezone

from controlplane.billing.models import UsageRecord
from controlplane.catalog.models import ServedModel

logger = logging.getLogger(__name__)


def new_job_id() -> str:
    return f"job_{secrets.token_hex(12)}"


def new_request_id() -> str:
    return f"req_{secrets.token_hex(12)}"


class JobManager(models.Manager["Job"]):
    def record_completion(self, payload: dict[str, Any]) -> bool:
        """Settle the job of a node's `record_completion` payload; False if it was already
        settled (a redelivery) or is unknown."""
        with transaction.atomic():
            # The row lock serialises concurrent deliveries of the same result.
            job = (
                self.select_for_update(of=("self",))
                .select_related("org", "api_key")
                .filter(request_id=payload["request_id"])
                .first()
            )
            if job is None:
                logger.warning("record_completion for unknown request %s", payload["request_id"])
                return False
            if job.status in Job.TERMINAL:
                return False
            now = timezone.now()
            job.node = payload.get("node") or ""
            job.finished_at = now
            job.started_at = job.started_at or now
            if payload.get("error"):
                job.status = Job.FAILED
                job.error = payload["error"]
                job.save()
                return True
            usage = payload["usage"]
            price = ServedModel.objects.get(id=job.model).current_price()
            record, _ = UsageRecord.objects.record(
                request_id=job.request_id,
                org=job.org,
                api_key=job.api_key,
                model=job.model,
                mode=job.mode,
                prompt_tokens=usage["prompt_tokens"],
                cached_tokens=usage["cached_tokens"],
                completion_tokens=usage["completion_tokens"],
                price=price,
            )
            job.status = Job.COMPLETED
            job.result = {
                "text": payload["text"],
                "token_ids": payload["token_ids"],
                "finish_reason": payload["finish_reason"],
                "usage": usage,
                "cost": str(record.total_cost),
                "timings": payload.get("timings") or {},
            }
            job.save()
            return True


class Job(models.Model):
    """One completion request and its outcome."""

    QUEUED, RUNNING, COMPLETED, FAILED = "queued", "running", "completed", "failed"
    STATUSES = [(s, s) for s in (QUEUED, RUNNING, COMPLETED, FAILED)]
    TERMINAL = frozenset({COMPLETED, FAILED})
    MODES = [("sync", "sync"), ("async", "async"), ("batch", "batch")]

    id = models.CharField(primary_key=True, max_length=40, default=new_job_id)
    request_id = models.CharField(max_length=40, unique=True, default=new_request_id)
    org = models.ForeignKey("accounts.Org", on_delete=models.CASCADE, related_name="jobs")
    api_key = models.ForeignKey(
        "accounts.ApiKey", on_delete=models.SET_NULL, null=True, related_name="jobs"
    )
    model = models.CharField(max_length=200)
    mode = models.CharField(max_length=8, choices=MODES, default="sync")
    status = models.CharField(max_length=16, choices=STATUSES, default=QUEUED, db_index=True)
    request = models.JSONField()  # the API request body, as received
    prompt_token_ids = models.JSONField()
    sampling = models.JSONField(default=dict)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True)
    node = models.CharField(max_length=200, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    created = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = JobManager()

    def start(self) -> bool:
        """queued → running, once; False if another delivery got there first."""
        now = timezone.now()
        claimed = Job.objects.filter(pk=self.pk, status=Job.QUEUED).update(
            status=Job.RUNNING, started_at=now, attempts=models.F("attempts") + 1
        )
        if claimed:
            self.status, self.started_at = Job.RUNNING, now
        return bool(claimed)

    def generation_message(self, reply_channel: str | None = None) -> dict[str, Any]:
        """The broker message body a node serves this job from (inference.node.protocol)."""
        return {
            "request_id": self.request_id,
            "job_id": self.id,
            "org": self.org.slug,
            "prompt_token_ids": self.prompt_token_ids,
            "sampling": self.sampling,
            "reply_channel": reply_channel,
            "deadline": None,
            "attempt": self.attempts + 1,
        }

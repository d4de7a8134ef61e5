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
from controlplane.events.models import Event

logger = logging.getLogger(__name__)


def new_job_id() -> str:
    return f"job_{secrets.token_hex(12)}"


def new_request_id() -> str:
    return f"req_{secrets.token_hex(12)}"


class JobManager(models.Manager["Job"]):
    def submit(self, **fields: Any) -> Job:
        """Create a queued job and its `job.queued` event together."""
        from controlplane.jobs.serializers import job_object

        with transaction.atomic():
            job = self.create(**fields)
            Event.objects.emit(job.org, "job.queued", job_object(job))
        return job

    def record_started(self, payload: dict[str, Any]) -> bool:
        """A node took the job's request: queued → running, once (a late or repeated notice,
        one that arrives after the result, changes nothing)."""
        job = self.select_related("org").filter(request_id=payload["request_id"]).first()
        return job is not None and job.start(node=payload.get("node") or "")

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
            if payload.get("error") is None and job.status == Job.QUEUED:
                # The worker took the result before the node's `record_started` notice (they are
                # separate messages): the job did run, so it passes through running here, and
                # the late notice finds it no longer queued.
                job.status, job.started_at = Job.RUNNING, now
                job.attempts += 1
                job.save(update_fields=["status", "started_at", "node", "attempts"])
                job.emit("job.running")
            job.finished_at = now
            job.started_at = job.started_at or now
            if payload.get("error"):
                job.status = Job.FAILED
                job.error = payload["error"]
                job.save()
                job.emit("job.failed")
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
                "cost": record.cost_object(),
                "timings": payload.get("timings") or {},
            }
            job.save()
            job.emit("job.completed")
            return True


class Job(models.Model):
    """One completion request and its outcome."""

    QUEUED, RUNNING, COMPLETED, FAILED = "queued", "running", "completed", "failed"
    STATUSES = [(s, s) for s in (QUEUED, RUNNING, COMPLETED, FAILED)]
    TERMINAL = frozenset({COMPLETED, FAILED})
    SYNC, ASYNC, BATCH = "sync", "async", "batch"
    MODES = [(SYNC, SYNC), (ASYNC, ASYNC), (BATCH, BATCH)]
    CHAT, TEXT = "chat.completions", "completions"
    ENDPOINTS = [(CHAT, CHAT), (TEXT, TEXT)]

    id = models.CharField(primary_key=True, max_length=40, default=new_job_id)
    request_id = models.CharField(max_length=40, unique=True, default=new_request_id)
    org = models.ForeignKey("accounts.Org", on_delete=models.CASCADE, related_name="jobs")
    api_key = models.ForeignKey(
        "accounts.ApiKey", on_delete=models.SET_NULL, null=True, related_name="jobs"
    )
    model = models.CharField(max_length=200)
    mode = models.CharField(max_length=8, choices=MODES, default="sync")
    endpoint = models.CharField(max_length=32, choices=ENDPOINTS, default=CHAT)
    session_affinity = models.CharField(max_length=200, blank=True)
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

    def start(self, node: str = "") -> bool:
        """queued → running, once; False if another delivery got there first."""
        now = timezone.now()
        with transaction.atomic():
            claimed = Job.objects.filter(pk=self.pk, status=Job.QUEUED).update(
                status=Job.RUNNING,
                started_at=now,
                node=node,
                attempts=models.F("attempts") + 1,
            )
            if claimed:
                self.refresh_from_db(fields=["status", "started_at", "node", "attempts"])
                self.emit("job.running")
        return bool(claimed)

    def fail(self, error: str) -> bool:
        """→ failed from queued or running, once (a job the control plane cannot hand on)."""
        now = timezone.now()
        with transaction.atomic():
            failed = Job.objects.filter(pk=self.pk, status__in=[Job.QUEUED, Job.RUNNING]).update(
                status=Job.FAILED, error=error, finished_at=now
            )
            if failed:
                self.status, self.error, self.finished_at = Job.FAILED, error, now
                self.emit("job.failed")
        return bool(failed)

    def emit(self, type: str) -> Event:
        """Record a state change of this job in the org's event log (and push it)."""
        from controlplane.jobs.serializers import job_object

        return Event.objects.emit(self.org, type, job_object(self))

    def generation_message(
        self, reply_channel: str | None = None, deadline: float | None = None
    ) -> dict[str, Any]:
        """The broker message body a node serves this job from (inference.node.protocol);
        `deadline` is epoch seconds after which the engine stops it."""
        return {
            "request_id": self.request_id,
            "job_id": self.id,
            "org": self.org.slug,
            "prompt_token_ids": self.prompt_token_ids,
            "sampling": self.sampling,
            "reply_channel": reply_channel,
            "deadline": deadline,
            "attempt": self.attempts + 1,
        }

"""Batches: OpenAI's Batch API over Hearth's jobs.

A batch is one Job per valid line of its input file (mode `batch`, with the line's `custom_id`),
all admitted when the batch is created, so a batch is as durable as any job and needs no
scheduler of its own. Its life: `in_progress` (jobs queued) → `finalizing` (every job settled;
the output and error files are being written) → `completed`, or `failed` (no line was valid),
`expired` (its completion window ended first: the jobs' deadline is the batch's `expires_at`,
so the jobs' own expiry ends them) or, after `cancel()`, `cancelling` → `cancelled`. The results
the jobs reached before it ended are always kept.

Counting: every terminal transition of a job emits exactly one event, in the transition's
transaction (`Job.emit`), and that is where the batch's `completed`/`failed` counters move, with
F() updates in the same transaction: a result delivered twice never counts twice, and a crash
never leaves a settled job uncounted. After that commit, `finalize_if_done` claims the
finalization with a conditional UPDATE (only when every line is counted), so of two settlements
that race to be last exactly one writes the files.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from typing import Any

from django.db import models, transaction
from django.db.models import F, Sum
from django.utils import timezone

from controlplane.api.responses import epoch_seconds
from controlplane.billing.models import UsageRecord
from controlplane.events.models import Event
from controlplane.jobs.files import File, parse_batch_lines
from controlplane.jobs.serializers import job_object

# The error code a line that never completed carries in the error file, by its job's status.
_JOB_ERROR_CODES = {
    "failed": "generation_failed",
    "expired": "batch_expired",
    "cancelled": "batch_cancelled",
}


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


class BatchManager(models.Manager["Batch"]):
    def job_settled(self, job) -> None:
        """Count a batch job that reached a terminal status; called once per job, inside the
        transaction that settled it (see the module docstring)."""
        field = "completed" if job.status == job.COMPLETED else "failed"
        self.filter(pk=job.batch_id).update(**{field: F(field) + 1})
        batch_id = job.batch_id
        # robust: the job's change is committed whatever happens here; a finalization that
        # failed is retried by the next read of the batch (finalize_if_done is cheap when the
        # batch is not done).
        transaction.on_commit(lambda: self.finalize_if_done(batch_id), robust=True)

    def finalize_if_done(self, batch_id: str) -> bool:
        """When every line of the batch is counted, write its output and error files and give
        it its final status, once: the conditional UPDATE to `finalizing` is the claim, and
        only its winner goes on. Claim, files and final status are one transaction, so a
        finalization that fails midway leaves the batch as it was, to be finalized again; a
        concurrent claimer waits on the row lock and then finds the batch no longer claimable.
        True when this call finalized it."""
        with transaction.atomic():
            claimed = self.filter(
                pk=batch_id,
                status__in=[Batch.IN_PROGRESS, Batch.CANCELLING],
                total=F("completed") + F("failed"),
            ).update(status=Batch.FINALIZING, finalizing_at=timezone.now())
            if claimed:
                self.select_related("org").get(pk=batch_id).finalize()
        return bool(claimed)


class Batch(models.Model):
    """A batch of completion requests read from an input file."""

    VALIDATING, IN_PROGRESS, FINALIZING = "validating", "in_progress", "finalizing"
    COMPLETED, FAILED, EXPIRED = "completed", "failed", "expired"
    CANCELLING, CANCELLED = "cancelling", "cancelled"
    STATUSES = [
        (s, s)
        for s in (
            VALIDATING,
            IN_PROGRESS,
            FINALIZING,
            COMPLETED,
            FAILED,
            EXPIRED,
            CANCELLING,
            CANCELLED,
        )
    ]

    id = models.CharField(primary_key=True, max_length=40, default=new_batch_id)
    org = models.ForeignKey("accounts.Org", on_delete=models.CASCADE, related_name="batches")
    api_key = models.ForeignKey(
        "accounts.ApiKey", on_delete=models.SET_NULL, null=True, related_name="batches"
    )
    endpoint = models.CharField(max_length=32)
    model = models.CharField(max_length=200, blank=True)
    # File ids, not foreign keys: a batch keeps naming its files after they are deleted, as
    # OpenAI's does.
    input_file_id = models.CharField(max_length=40)
    output_file_id = models.CharField(max_length=40, blank=True)
    error_file_id = models.CharField(max_length=40, blank=True)
    completion_window = models.CharField(max_length=8)
    metadata = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=STATUSES, default=VALIDATING)
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)  # invalid lines included
    # Lines that never became jobs: {line, custom_id, code, message, param}.
    invalid_lines = models.JSONField(default=list)
    usage = models.JSONField(null=True, blank=True)
    created = models.DateTimeField(auto_now_add=True)
    in_progress_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    objects = BatchManager()

    class Meta:
        indexes = [models.Index(fields=["org", "-created", "-id"], name="batch_org_created")]

    def cancel(self) -> None:
        """`cancelling`, then cancel every unsettled job: queued ones at once, running ones on
        their nodes (they settle cancelled, billed for what they generated). When the last one
        settles the batch is `cancelled`, with what completed before in its output file. A batch
        already ending is left as it is."""
        started = Batch.objects.filter(pk=self.pk, status=Batch.IN_PROGRESS).update(
            status=Batch.CANCELLING, cancelling_at=timezone.now()
        )
        if started:
            unsettled = self.jobs.select_related("org").exclude(status__in=self.jobs.model.TERMINAL)
            for job in unsettled.order_by("created"):
                job.cancel()
            Batch.objects.finalize_if_done(self.pk)  # nothing was left to settle
        self.refresh_from_db()

    def finalize(self) -> None:
        """Write the output and error files and set the final status; only the claimer of
        `finalizing` calls this (BatchManager.finalize_if_done)."""
        jobs = list(self.jobs.select_related("org"))
        order = self._line_order()
        jobs.sort(key=lambda job: (order.get(job.custom_id, len(order)), job.created))
        output, errors = [], []
        for job in jobs:
            request_id = f"batch_req_{job.id.removeprefix('job_')}"
            if job.status == job.COMPLETED:
                response = {
                    "status_code": 200,
                    "request_id": job.request_id,
                    "body": job_object(job)["response"],
                }
                output.append(
                    {
                        "id": request_id,
                        "custom_id": job.custom_id,
                        "response": response,
                        "error": None,
                    }
                )
            else:
                code = _JOB_ERROR_CODES.get(job.status, "generation_failed")
                error = {"code": code, "message": job.error or f"the request was {job.status}"}
                errors.append(
                    {"id": request_id, "custom_id": job.custom_id, "response": None, "error": error}
                )
        for invalid in self.invalid_lines:
            errors.append(
                {
                    "id": f"batch_req_{secrets.token_hex(12)}",
                    "custom_id": invalid["custom_id"],
                    "response": None,
                    "error": {"code": invalid["code"], "message": invalid["message"]},
                }
            )
        errors.sort(key=lambda entry: order.get(entry["custom_id"], len(order)))
        totals = UsageRecord.objects.filter(
            request_id__in=[job.request_id for job in jobs if job.result]
        ).aggregate(
            input=Sum("prompt_tokens"), cached=Sum("cached_tokens"), output=Sum("completion_tokens")
        )
        now = timezone.now()
        if self.cancelling_at is not None:
            status = Batch.CANCELLED
        elif any(job.status == job.EXPIRED for job in jobs):
            status = Batch.EXPIRED
        elif not jobs:
            status = Batch.FAILED
        else:
            status = Batch.COMPLETED
        with transaction.atomic():
            self.output_file_id = self._write_file("output", output)
            self.error_file_id = self._write_file("error", errors)
            self.usage = {
                "input_tokens": totals["input"] or 0,
                "input_tokens_details": {"cached_tokens": totals["cached"] or 0},
                "output_tokens": totals["output"] or 0,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": (totals["input"] or 0) + (totals["output"] or 0),
            }
            self.status = status
            setattr(self, f"{status}_at", now)
            self.save()
            self.emit(f"batch.{status}")

    def _line_order(self) -> dict[str, int]:
        """custom_id → line number, from the input file (empty when it was deleted)."""
        input_file = File.objects.filter(pk=self.input_file_id).first()
        if input_file is None:
            return {}
        return {line.custom_id: line.line for line in parse_batch_lines(bytes(input_file.content))}

    def _write_file(self, kind: str, entries: Iterable[dict]) -> str:
        content = "".join(json.dumps(entry, separators=(",", ":")) + "\n" for entry in entries)
        if not content:
            return ""
        stored = File.objects.create(
            org=self.org,
            filename=f"{self.id}_{kind}.jsonl",
            purpose=File.BATCH_OUTPUT,
            bytes=len(content.encode()),
            content=content.encode(),
        )
        return stored.id

    def emit(self, type: str) -> Event:
        """Record a state change of this batch in the org's event log (and push it)."""
        return Event.objects.emit(self.org, type, self.as_object())

    def as_object(self) -> dict[str, Any]:
        """OpenAI's Batch object. Fields without a value are left out rather than null: the
        published schema types them as plain strings and integers."""

        errors = None
        if self.status == Batch.FAILED and self.invalid_lines:
            errors = {
                "object": "list",
                "data": [
                    {
                        "code": invalid["code"],
                        "message": invalid["message"],
                        "param": invalid["param"],
                        "line": invalid["line"],
                    }
                    for invalid in self.invalid_lines[:100]
                ],
            }
        fields = {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model or None,
            "errors": errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id or None,
            "error_file_id": self.error_file_id or None,
            "created_at": epoch_seconds(self.created),
            "in_progress_at": epoch_seconds(self.in_progress_at),
            "expires_at": epoch_seconds(self.expires_at),
            "finalizing_at": epoch_seconds(self.finalizing_at),
            "completed_at": epoch_seconds(self.completed_at),
            "failed_at": epoch_seconds(self.failed_at),
            "expired_at": epoch_seconds(self.expired_at),
            "cancelling_at": epoch_seconds(self.cancelling_at),
            "cancelled_at": epoch_seconds(self.cancelled_at),
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "usage": self.usage,
            "metadata": self.metadata,
        }
        return {name: value for name, value in fields.items() if value is not None}

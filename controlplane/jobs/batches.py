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

import contextlib
import itertools
import json
import secrets
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.db.models import F, Sum
from django.utils import timezone

from controlplane.catalog.registry import live_nodes
from controlplane.events.models import Event
from controlplane.gateway.errors import ApiError
from controlplane.gateway.responses import epoch_seconds
from controlplane.gateway.routing import choose_route
from controlplane.jobs.files import BATCH_URLS, File, parse_batch_lines

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
# OpenAI's metadata limits: 16 pairs, keys up to 64 characters, values up to 512.
METADATA_MAX_PAIRS, METADATA_MAX_KEY, METADATA_MAX_VALUE = 16, 64, 512
# The error code a line that never completed carries in the error file, by its job's status.
_JOB_ERROR_CODES = {
    "failed": "generation_failed",
    "expired": "batch_expired",
    "cancelled": "batch_cancelled",
}


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


class BatchRejected(Exception):
    """A batch that cannot be created; `param` names the request field to blame."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def common_prefix_len(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def wants_one_node(sorted_prompts: list[list[int]]) -> bool:
    """Whether a batch's prompts for one model (sorted) share prefixes enough to send them all
    to one node.

    The prefix cache is per node: lines that share a system prompt or a long document only hit
    it when they run where that prefix was computed. On the shared queue every node with room
    pulls lines, and each recomputes the prefix; on one node's queue the prefix is computed
    once. Only full KV blocks are cached, so a shared prefix shorter than one block
    (`BATCH_AFFINITY_PREFIX_TOKENS`, the engine's 16) gains nothing, and a small batch is not
    worth giving up the other nodes for. Half of the neighbouring pairs sharing a block is
    "many"."""
    if len(sorted_prompts) < settings.BATCH_AFFINITY_MIN_LINES:
        return False
    shared = sum(
        common_prefix_len(a, b) >= settings.BATCH_AFFINITY_PREFIX_TOKENS
        for a, b in itertools.pairwise(sorted_prompts)
    )
    return 2 * shared >= len(sorted_prompts) - 1


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > METADATA_MAX_PAIRS
        or not all(
            isinstance(k, str)
            and isinstance(v, str)
            and len(k) <= METADATA_MAX_KEY
            and len(v) <= METADATA_MAX_VALUE
            for k, v in metadata.items()
        )
    ):
        raise BatchRejected(
            f"'metadata' must be an object of at most {METADATA_MAX_PAIRS} string pairs (keys up "
            f"to {METADATA_MAX_KEY} characters, values up to {METADATA_MAX_VALUE}).",
            "metadata",
        )
    return metadata


class BatchManager(models.Manager["Batch"]):
    def create_batch(
        self,
        principal,
        input_file: File,
        endpoint: Any,
        completion_window: Any,
        metadata: Any = None,
    ) -> Batch:
        """Create a batch from an uploaded input file and queue one job per valid line.

        Each line's body goes through the completion endpoints' own admission step (validation,
        tokenization, context check); a line that fails it becomes no job and goes to the error
        file with its error. BatchRejected for a bad request as a whole.

        Dispatch order: the jobs are enqueued sorted by their prompt token ids, so lines that
        share a prefix (a system prompt, a document asked several questions) reach the nodes
        back to back and the second finds the first's KV blocks still in the prefix cache, not
        evicted by unrelated prompts in between. When most lines share a prefix
        (`wants_one_node`), they all go to one node through the routing's session affinity
        (`batch:<id>`), since a prefix cached on one node does not help another."""
        # The gateway's admission imports the Job model, which imports this module.
        from controlplane.gateway.admission import enqueue_job, prepare_request, submit_prepared
        from controlplane.jobs.models import Job

        if endpoint not in BATCH_URLS:
            raise BatchRejected(f"'endpoint' must be one of {sorted(BATCH_URLS)}.", "endpoint")
        if completion_window not in COMPLETION_WINDOWS:
            raise BatchRejected(
                f"'completion_window' must be one of {sorted(COMPLETION_WINDOWS)}.",
                "completion_window",
            )
        metadata = _check_metadata(metadata)
        if input_file.purpose != File.BATCH:
            raise BatchRejected(
                f"The file '{input_file.id}' was not uploaded with purpose 'batch'.",
                "input_file_id",
            )
        lines = parse_batch_lines(bytes(input_file.content))
        for line in lines:
            if line.url != endpoint:
                raise BatchRejected(
                    f"Line {line.line} of the input file asks for {line.url}, not the batch's "
                    f"endpoint {endpoint}.",
                    "endpoint",
                )
        job_endpoint = BATCH_URLS[endpoint]
        prepared, invalid = [], []
        for line in lines:
            try:
                if line.body.get("stream") is True:
                    raise ApiError(400, "Batch requests cannot stream.", "stream", "invalid_value")
                prepared.append((line, prepare_request(line.body, job_endpoint)))
            except ApiError as error:
                invalid.append(
                    {
                        "line": line.line,
                        "custom_id": line.custom_id,
                        "code": error.code or "invalid_request",
                        "message": error.message,
                        "param": error.param,
                    }
                )
        # Shared prefixes back to back; lines of one model together.
        prepared.sort(key=lambda item: (item[1].model.id, item[1].prompt_token_ids))
        now = timezone.now()
        expires_at = now + COMPLETION_WINDOWS[completion_window]
        deadline = expires_at.timestamp()
        batch_id = new_batch_id()
        affinity = {}
        for model_id in {p.model.id for _, p in prepared}:
            prompts = [p.prompt_token_ids for _, p in prepared if p.model.id == model_id]
            affinity[model_id] = f"batch:{batch_id}" if wants_one_node(prompts) else ""
        with transaction.atomic():
            batch = self.create(
                id=batch_id,
                org=principal.org,
                api_key=principal.api_key,
                endpoint=endpoint,
                model=prepared[0][1].model.id if prepared else "",
                input_file_id=input_file.id,
                completion_window=completion_window,
                metadata=metadata,
                status=Batch.IN_PROGRESS,
                total=len(lines),
                failed=len(invalid),
                invalid_lines=invalid,
                in_progress_at=now,
                expires_at=expires_at,
            )
            jobs = [
                submit_prepared(
                    request,
                    principal,
                    job_endpoint,
                    mode=Job.BATCH,
                    deadline=deadline,
                    session_affinity=affinity[request.model.id],
                    batch=batch,
                    custom_id=line.custom_id,
                )
                for line, request in prepared
            ]
            batch.emit("batch.in_progress")
        for job in jobs:
            route = choose_route(job.model, live_nodes(job.model), job.session_affinity or None)
            # A refused enqueue fails its job (counted failed); the batch goes on with the others.
            with contextlib.suppress(ApiError):
                enqueue_job(job, route, None, deadline)
        Batch.objects.finalize_if_done(batch.id)  # a batch without a valid line ends here
        batch.refresh_from_db()
        return batch

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
        from controlplane.jobs.models import Job

        started = Batch.objects.filter(pk=self.pk, status=Batch.IN_PROGRESS).update(
            status=Batch.CANCELLING, cancelling_at=timezone.now()
        )
        if started:
            unsettled = self.jobs.select_related("org").exclude(status__in=Job.TERMINAL)
            for job in unsettled.order_by("created"):
                job.cancel()
            Batch.objects.finalize_if_done(self.pk)  # nothing was left to settle
        self.refresh_from_db()

    def finalize(self) -> None:
        """Write the output and error files and set the final status; only the claimer of
        `finalizing` calls this (BatchManager.finalize_if_done)."""
        from controlplane.billing.models import UsageRecord
        from controlplane.jobs.serializers import job_object

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

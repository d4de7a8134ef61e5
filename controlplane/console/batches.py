"""The batches pages: the org's batches with their progress, one batch's counts, files and jobs,
and the download of a batch's files (input, output, errors).

The same reads as the Batch API (controlplane/gateway/batches_api.py): overdue jobs are expired
first, and a batch whose last job settled but whose finalization failed is finalized by the
read. Another org's batch or file is a 404.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import path
from django.utils.http import content_disposition_header
from django.views.decorators.http import require_GET

from controlplane.console.roles import console_view
from controlplane.jobs.batches import Batch
from controlplane.jobs.files import File
from controlplane.jobs.models import Job

# The list shows this many of the newest batches; a batch's page this many of its jobs.
BATCHES_SHOWN = 100
JOBS_SHOWN = 100
# The statuses a batch ends in, and the field each records its end in.
ENDED_AT = {
    Batch.COMPLETED: "completed_at",
    Batch.FAILED: "failed_at",
    Batch.EXPIRED: "expired_at",
    Batch.CANCELLED: "cancelled_at",
}


def progress(batch: Batch) -> dict[str, Any]:
    """The batch with its settled lines (completed and failed), their percent of the total, and
    when it ended (None while it runs)."""
    settled = batch.completed + batch.failed
    ended = ENDED_AT.get(batch.status)
    return {
        "batch": batch,
        "settled": settled,
        "percent": settled * 100 // batch.total if batch.total else 0,
        "ended_at": getattr(batch, ended) if ended else None,
    }


@require_GET
@console_view("batches")
def batches(request: HttpRequest) -> HttpResponse:
    """The org's newest batches with their progress."""
    Job.objects.expire_overdue(org=request.org)
    newest = Batch.objects.filter(org=request.org).order_by("-created", "-id")[:BATCHES_SHOWN]
    context = {"rows": [progress(batch) for batch in newest], "batches_shown": BATCHES_SHOWN}
    return render(request, "console/batches.html", context)


@require_GET
@console_view("batches")
def batch(request: HttpRequest, batch_id: str) -> HttpResponse:
    """One batch: its progress and counts, its files, its first jobs."""
    found = get_object_or_404(Batch.objects.select_related("org"), id=batch_id, org=request.org)
    if found.status in (Batch.IN_PROGRESS, Batch.CANCELLING):
        Job.objects.expire_overdue(org=request.org)
        Batch.objects.finalize_if_done(found.id)
        found.refresh_from_db()
    file_ids = [found.input_file_id, found.output_file_id, found.error_file_id]
    files = File.objects.filter(org=request.org, id__in=[i for i in file_ids if i]).defer("content")
    stored = {f.id: f for f in files}
    kinds = zip(("input", "output", "error"), file_ids, strict=True)
    context = {
        **progress(found),
        # Each of its files: its kind, id (blank: none written) and the stored file (None: deleted).
        "files": [
            {"kind": kind, "id": file_id, "file": stored.get(file_id)} for kind, file_id in kinds
        ],
        "jobs": found.jobs.order_by("created", "id")[:JOBS_SHOWN],
        "jobs_shown": JOBS_SHOWN,
        "running": found.status not in ENDED_AT,
    }
    return render(request, "console/batch.html", context)


@require_GET
@console_view("batches")
def file_content(request: HttpRequest, file_id: str) -> HttpResponse:
    """The file's bytes as stored (JSON Lines), as a download."""
    found = get_object_or_404(File, id=file_id, org=request.org)
    response = HttpResponse(bytes(found.content), content_type="application/jsonl")
    response["Content-Disposition"] = content_disposition_header(True, found.filename)
    return response


urlpatterns = [
    path("batches", batches, name="batches"),
    path("batches/<str:batch_id>", batch, name="batch"),
    path("files/<str:file_id>/content", file_content, name="file-content"),
]

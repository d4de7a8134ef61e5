"""The jobs API: `GET /v1/jobs`, `GET /v1/jobs/{id}`, `POST /v1/jobs/{id}/cancel`.

A job of another org is a 404, never a 403. Reads first expire the org's queued jobs that passed
their deadline (`Job.objects.expire_overdue`), so a job never shows queued past it even when no
sweep has run. A queued job also shows its place in its model's queue and an estimate of when it
starts.
"""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Q
from django.utils import timezone
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.gateway.pagination import cursor_page
from controlplane.jobs.models import Job
from controlplane.jobs.serializers import job_object

# The window the queue-time estimate measures the model's recent throughput over.
THROUGHPUT_WINDOW = timedelta(minutes=5)


def _org_job(request: Request, job_id: str) -> Job:
    job = Job.objects.select_related("org").filter(id=job_id, org=request.user.org).first()
    if job is None:
        raise NotFound(f"No job with id '{job_id}'.", code="job_not_found")
    return job


def queue_estimate(job: Job) -> dict:
    """`queue_position` (queued jobs of the same model ahead of it, every org's: they share the
    nodes) and `estimated_start_s` (position over the model's completions per second in the last
    five minutes; null without recent completions)."""
    if job.status != Job.QUEUED:
        return {"queue_position": None, "estimated_start_s": None}
    ahead = Job.objects.filter(status=Job.QUEUED, model=job.model).filter(
        Q(created__lt=job.created) | Q(created=job.created, id__lt=job.id)
    )
    position = ahead.count()
    since = timezone.now() - THROUGHPUT_WINDOW
    recent = Job.objects.filter(model=job.model, finished_at__gte=since).count()
    eta = None
    if recent:
        eta = round((position + 1) / (recent / THROUGHPUT_WINDOW.total_seconds()), 1)
    return {"queue_position": position, "estimated_start_s": eta}


class JobList(APIView):
    """The org's jobs, newest first: `limit` (1–100), `after` (a job id: the page after it),
    `status` (one of the statuses)."""

    def get(self, request: Request) -> Response:
        org = request.user.org
        Job.objects.expire_overdue(org=org)
        jobs = Job.objects.select_related("org").filter(org=org)
        status = request.query_params.get("status")
        if status is not None:
            if status not in dict(Job.STATUSES):
                raise ValidationError(
                    {"status": [f"'status' must be one of {sorted(dict(Job.STATUSES))}."]}
                )
            jobs = jobs.filter(status=status)
        return cursor_page(
            jobs, Job, request, lambda job: {**job_object(job), **queue_estimate(job)}
        )


class JobDetail(APIView):
    def get(self, request: Request, job_id: str) -> Response:
        job = _org_job(request, job_id)
        if job.status == Job.QUEUED:
            Job.objects.expire_overdue(org=job.org)
            job.refresh_from_db()
        return Response({**job_object(job), **queue_estimate(job)})


class JobCancel(APIView):
    """Cancel a job: a queued one at once (`cancelled`); a running one is stopped on its node and
    turns `cancelled` when the node reports what it generated, which is billed. A settled job is
    returned as it is (cancelling twice is not an error, as OpenAI's batch cancel)."""

    def post(self, request: Request, job_id: str) -> Response:
        job = _org_job(request, job_id)
        job.cancel()
        return Response({**job_object(job), **queue_estimate(job)})

"""`GET /v1/jobs/{id}`: a job of the caller's org (another org's is a 404, never a 403)."""

from __future__ import annotations

from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.jobs.models import Job
from controlplane.jobs.serializers import job_object


class JobDetail(APIView):
    def get(self, request: Request, job_id: str) -> Response:
        job = Job.objects.filter(id=job_id, org=request.user.org).first()
        if job is None:
            raise NotFound(f"No job with id '{job_id}'.", code="job_not_found")
        return Response(job_object(job))

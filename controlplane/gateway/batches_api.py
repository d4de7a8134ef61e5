"""OpenAI's Files and Batch API: `/v1/files…` and `/v1/batches…`.

Thin views over `controlplane/jobs/files.py` and `batches.py`. Another org's file or batch is a
404, never a 403. Batch reads first expire the org's overdue queued jobs (as the jobs API does),
so a batch past its completion window shows `expired` even when no sweep has run.
"""

from __future__ import annotations

from django.conf import settings
from django.http import HttpResponse
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.dispatch.batches import BatchRejected, create_batch
from controlplane.gateway.pagination import cursor_page
from controlplane.jobs.batches import Batch
from controlplane.jobs.files import File, FileRejected
from controlplane.jobs.models import Job


def _org_file(request: Request, file_id: str) -> File:
    found = File.objects.filter(id=file_id, org=request.user.org).first()
    if found is None:
        raise NotFound(f"No file with id '{file_id}'.", code="file_not_found")
    return found


def _org_batch(request: Request, batch_id: str) -> Batch:
    found = Batch.objects.select_related("org").filter(id=batch_id, org=request.user.org).first()
    if found is None:
        raise NotFound(f"No batch with id '{batch_id}'.", code="batch_not_found")
    return found


class FileList(APIView):
    """`POST /v1/files` (multipart: `file`, `purpose=batch`) and `GET /v1/files`."""

    parser_classes = [MultiPartParser, FormParser]

    def post(self, request: Request) -> Response:
        upload = request.FILES.get("file")
        if upload is None:
            raise ValidationError({"file": ["A 'file' part is required."]})
        purpose = request.data.get("purpose")
        if purpose != File.BATCH:
            raise ValidationError({"purpose": ["'purpose' must be 'batch'."]})
        if upload.size > settings.FILES_MAX_BYTES:
            # Refused before its bytes are read into memory.
            raise ValidationError(
                {"file": [f"Files may be at most {settings.FILES_MAX_BYTES} bytes."]}
            )
        try:
            stored = File.objects.upload(request.user.org, upload.name, purpose, upload.read())
        except FileRejected as rejected:
            raise ValidationError({"file": [str(rejected)]}) from None
        return Response(stored.as_object())

    def get(self, request: Request) -> Response:
        files = File.objects.filter(org=request.user.org).defer("content")
        purpose = request.query_params.get("purpose")
        if purpose is not None:
            files = files.filter(purpose=purpose)
        return cursor_page(files, File, request, File.as_object)


class FileDetail(APIView):
    def get(self, request: Request, file_id: str) -> Response:
        return Response(_org_file(request, file_id).as_object())

    def delete(self, request: Request, file_id: str) -> Response:
        found = _org_file(request, file_id)
        found.delete()
        return Response({"id": file_id, "object": "file", "deleted": True})


class AnyAccept(BaseContentNegotiation):
    """The content endpoint answers bytes whatever the client accepts (the SDK asks for
    `application/binary`); its errors are still JSON."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class FileContent(APIView):
    """The file's bytes as stored; JSON Lines for batch files."""

    content_negotiation_class = AnyAccept

    def get(self, request: Request, file_id: str) -> HttpResponse:
        found = _org_file(request, file_id)
        response = HttpResponse(bytes(found.content), content_type="application/jsonl")
        response["content-disposition"] = f'attachment; filename="{found.filename}"'
        return response


class BatchList(APIView):
    """`POST /v1/batches` {input_file_id, endpoint, completion_window, metadata?} and
    `GET /v1/batches` (newest first, `limit`, `after`)."""

    parser_classes = [JSONParser]

    def post(self, request: Request) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise ValidationError({"input_file_id": ["'input_file_id' is required."]})
        input_file = File.objects.filter(id=file_id, org=request.user.org).first()
        if input_file is None:
            raise NotFound(f"No file with id '{file_id}'.", code="file_not_found")
        try:
            batch = create_batch(
                request.user,
                input_file,
                body.get("endpoint"),
                body.get("completion_window"),
                body.get("metadata"),
            )
        except BatchRejected as rejected:
            raise ValidationError({rejected.param: [str(rejected)]}) from None
        return Response(batch.as_object())

    def get(self, request: Request) -> Response:
        org = request.user.org
        Job.objects.expire_overdue(org=org)
        return cursor_page(Batch.objects.filter(org=org), Batch, request, Batch.as_object)


class BatchDetail(APIView):
    def get(self, request: Request, batch_id: str) -> Response:
        batch = _org_batch(request, batch_id)
        if batch.status in (Batch.IN_PROGRESS, Batch.CANCELLING):
            Job.objects.expire_overdue(org=batch.org)
            # Finishes a batch whose finalization failed after its last job settled.
            Batch.objects.finalize_if_done(batch.id)
            batch.refresh_from_db()
        return Response(batch.as_object())


class BatchCancel(APIView):
    """Cancel a batch: `cancelling` until its running jobs stop, then `cancelled` with what
    completed before kept in its output file. A batch already ending is returned as it is."""

    def post(self, request: Request, batch_id: str) -> Response:
        batch = _org_batch(request, batch_id)
        batch.cancel()
        return Response(batch.as_object())

"""The completion endpoints as the gateway sees them: counted, timed, and logged with their ids.

`@observed` decorates `POST /v1/chat/completions` and `POST /v1/completions` (gateway/
completions.py); the view calls `admitted(request, admission)` once it has admitted the request,
which names the request's model for its series and binds its ids to the log context
(inference/protocol/logs.py). Shared families (controlplane/metrics.py: every gateway process
adds to the same Redis hashes, flushed every second, so whichever process Prometheus reaches
answers for all of them):

- `hearth_gateway_requests_total{endpoint, model, status}`: every request, once the gateway is
  done with it: its HTTP status, or 499 when the client left first (the view was cancelled, or a
  stream was closed before its end). `model` is the admitted job's; empty for a request refused
  before admission (a bad key, an invalid body, an unknown model, a rate limit), whose model is
  not known to be served, and a string the client chose must not become a label.
- `hearth_gateway_request_duration_seconds{endpoint, model, mode}`: admitted requests answered
  with a 2xx, from the view's start to the answer's end (a stream's last chunk); `mode` is
  `sync`, `stream`, or `async` (a 202 and its job).
- `hearth_gateway_ttft_seconds{endpoint, model}`: streamed requests, from the view's start to
  the stream's first chunk, which the gateway sends once the node's first token has reached it.

Each request also writes one log line when it is done (method, path, status, seconds), with its
request id, job id and org once admitted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from controlplane.dispatch.admission import Admission
from controlplane.metrics import SharedFamily, flush_every
from inference.protocol import buckets
from inference.protocol.logs import bind_log_context, log_context

logger = logging.getLogger(__name__)

REQUESTS = SharedFamily(
    "hearth_gateway_requests_total",
    "Completion requests, by the status the gateway answered (499: the client left first).",
    ("endpoint", "model", "status"),
)
DURATION = SharedFamily(
    "hearth_gateway_request_duration_seconds",
    "Admitted completion requests answered with a 2xx, from their arrival to the answer's end.",
    ("endpoint", "model", "mode"),
    buckets.REQUEST_SECONDS,
)
TTFT = SharedFamily(
    "hearth_gateway_ttft_seconds",
    "Streamed completion requests, from their arrival to the stream's first chunk.",
    ("endpoint", "model"),
    buckets.TTFT_SECONDS,
)
FAMILIES = [REQUESTS, DURATION, TTFT]
CLIENT_LEFT = 499
FLUSH_EVERY_S = 1.0
_ADMISSION = "hearth_admission"  # the request's attribute `admitted` sets

AsyncView = Callable[..., Awaitable[HttpResponse]]


def admitted(request: HttpRequest, admission: Admission) -> None:
    """The view admitted `request`: its series carry the job's model, and the rest of its
    handling logs the job's ids."""
    setattr(request, _ADMISSION, admission)
    job = admission.job
    bind_log_context(request_id=job.request_id, job_id=job.id, org=job.org.slug)


def observed(view: AsyncView) -> AsyncView:
    """Count, time and log each request to the async completion `view` (module docstring)."""

    @wraps(view)
    async def observed_view(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        started = time.monotonic()
        try:
            with log_context():  # the view's own: its ids end with it
                response = await view(request, *args, **kwargs)
        except asyncio.CancelledError:
            _done(request, started, CLIENT_LEFT)
            raise
        except Exception:
            _done(request, started, 500)  # what Django answers for it
            raise
        if response.streaming and response.status_code < 300:
            response.streaming_content = _timed(
                request, started, response.status_code, response.streaming_content
            )
        else:
            _done(request, started, response.status_code)
        return response

    return observed_view


async def _timed(
    request: HttpRequest, started: float, status: int, content: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """The stream's chunks, its first timed; counted when it ends, or when it is closed first."""
    first, ended = True, False
    try:
        async for chunk in content:
            if first:
                first = False
                admission = getattr(request, _ADMISSION, None)
                if admission is not None:
                    TTFT.observe((request.path, admission.job.model), time.monotonic() - started)
            yield chunk
        ended = True
    finally:
        _done(request, started, status if ended else CLIENT_LEFT)


def _done(request: HttpRequest, started: float, status: int) -> None:
    seconds = time.monotonic() - started
    admission: Admission | None = getattr(request, _ADMISSION, None)
    model = admission.job.model if admission is not None else ""
    REQUESTS.inc((request.path, model, str(status)))
    ids = {}
    if admission is not None:
        job = admission.job
        ids = {"request_id": job.request_id, "job_id": job.id, "org": job.org.slug}
        if 200 <= status < 300:
            DURATION.observe((request.path, model, _mode(admission)), seconds)
    if settings.REDIS_URL:
        flush_every(FLUSH_EVERY_S)
    with log_context(**ids):
        logger.log(
            logging.WARNING if status >= 500 else logging.INFO,
            "%s %s %d in %.3f s",
            request.method,
            request.path,
            status,
            seconds,
            extra={"model": model} if model else {},
        )


def _mode(admission: Admission) -> str:
    if admission.request.queue:
        return "async"
    return "stream" if admission.request.stream else "sync"

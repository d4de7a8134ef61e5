"""`POST /v1/chat/completions` and `POST /v1/completions`: async views.

Admission (auth, validation, tokenization, the Job row, the enqueue) runs in a worker thread; the
event loop then only waits on the reply channel, so hundreds of open streams cost no threads. A
queued request (`queue: true`) answers 202 with its job at once. A synchronous one relays the
node's deltas: as SSE chunks when it streams, or gathered into one response when it does not.
The node's `done` message carries the same usage the worker bills (`record_completion`), so the
response and its usage row agree.

A client that hangs up before its answer is complete (Django cancels the view, or the stream's
generator, on `http.disconnect`) cancels its job: a queued one never runs, a running one is
stopped on its node and billed for what it generated, as `POST /v1/jobs/{id}/cancel` does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from controlplane import layer_receive
from controlplane.api.auth import ApiKeyPrincipal, authenticate
from controlplane.api.errors import ApiError, error_answered
from controlplane.api.responses import (
    completion_response,
    node_choices,
    parses_tool_calls,
    stream_chunk,
    tool_call_id,
)
from controlplane.dispatch.admission import Admission, admit
from controlplane.gateway.idempotency import idempotent
from controlplane.gateway.request_metrics import admitted, observed
from controlplane.jobs.models import Job
from controlplane.jobs.serializers import job_object
from inference.structured.tool_calls import ToolCallStream

logger = logging.getLogger(__name__)

# Admissions run in a pool of their own, wider than asyncio's default (cores + 4): an admission
# spends most of its time waiting (on Redis, and on its group's commit: group_commit.py), and the
# more admissions wait together, the more share a commit (docs/performance.md).
ADMISSIONS = ThreadPoolExecutor(settings.ADMISSION_THREADS, thread_name_prefix="hearth-admission")


@csrf_exempt
@observed
@idempotent
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _complete(request, Job.CHAT)


@csrf_exempt
@observed
@idempotent
async def completions(request: HttpRequest) -> HttpResponse:
    return await _complete(request, Job.TEXT)


@observed
async def chat_completions_as(request: HttpRequest, principal: ApiKeyPrincipal) -> HttpResponse:
    """`chat_completions` for a request that carries no API key, admitted as `principal`: the
    console playground's, which acts through its org's key without holding its secret. Counted
    and logged as the API's are, under the playground's path."""
    return await _complete(request, Job.CHAT, principal)


async def _complete(
    request: HttpRequest, endpoint: str, principal: ApiKeyPrincipal | None = None
) -> HttpResponse:
    if request.method != "POST":
        return ApiError(405, f"Use POST for /v1/{endpoint}.", code="method_not_allowed").response()
    layer = get_channel_layer()
    reply_channel = await layer.new_channel()
    try:
        admission = await sync_to_async(admit, thread_sensitive=False, executor=ADMISSIONS)(
            principal or request.headers.get("Authorization", ""),
            request.body,
            endpoint,
            request.headers.get("x-session-affinity") or None,
            reply_channel,
        )
    except ApiError as error:
        org_id = principal.org.id if principal is not None else None
        authorization = request.headers.get("Authorization", "")
        return await _refused(error, authorization=authorization, org_id=org_id)
    admitted(request, admission)  # its metrics' model, its log lines' ids (request_metrics.py)
    if admission.request.queue:
        response = JsonResponse(job_object(admission.job), status=202)
        return _with_headers(response, admission, admission.route.node, None)
    deadline = time.monotonic() + settings.SYNC_REQUEST_TIMEOUT_S
    done: dict = {}
    try:
        done = await _receive(layer, reply_channel, deadline, admission.job)
        if admission.request.stream:
            return _stream(layer, reply_channel, deadline, admission, done)
        while done["type"] == "delta":
            done = await _receive(layer, reply_channel, deadline, admission.job)
    except ApiError as error:
        response = await _refused(error, org_id=admission.job.org_id)
        return _with_headers(response, admission, admission.route.node, None)
    except asyncio.CancelledError:
        _abandon(admission.job, done.get("node"))  # the last delta says where it runs
        raise
    job = admission.job
    body = completion_response(
        endpoint,
        job.request_id,
        job.model,
        int(job.created.timestamp()),
        done,
        tool_calls=parses_tool_calls(job.request),
    )
    return _with_headers(
        JsonResponse(body),
        admission,
        done.get("node"),
        done["usage"]["cached_tokens"],
        done.get("prefill_node"),
    )


async def _refused(error: ApiError, authorization: str = "", org_id: int | None = None):
    """The error's response, announced (`error_answered`, for the dashboard's count) for the org
    it answers: `org_id`, or the org of the key in `authorization`. A 401 answers no org."""
    if org_id is not None or error.status != 401:
        count = partial(_announce_error, error, authorization, org_id)
        await sync_to_async(count, thread_sensitive=False, executor=ADMISSIONS)()
    return error.response()


def _announce_error(error: ApiError, authorization: str, org_id: int | None) -> None:
    try:
        if org_id is None:
            # The key admission authenticated before it refused: this process's cache has it.
            org_id = authenticate(authorization).org.id
        error_answered.send(ApiError, org_id=org_id, status=error.status, code=error.code)
    except ApiError:
        pass  # the key itself was refused: no org to count it for
    finally:
        close_old_connections()


# How long a reply channel may stay quiet before the gateway looks at the job itself: a delta is
# best-effort, and a lost `done` must not leave the client waiting when the job has its result.
QUIET_S = 2.0


async def _receive(layer, channel: str, deadline: float, job: Job) -> dict:
    """The next message for this request; ApiError for a node's error or a timeout. When the
    channel stays quiet, a job already settled by `record_completion` answers instead."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ApiError(
                504,
                f"No answer within {settings.SYNC_REQUEST_TIMEOUT_S:g} s; the request is still "
                "queued as a job. Use queue: true for work that may wait.",
                code="timeout",
            )
        try:
            message = await layer_receive.receive(layer, channel, min(remaining, QUIET_S))
        except TimeoutError:
            message = await sync_to_async(_settled_message, thread_sensitive=False)(job.pk)
            layer_receive.raise_if_cancelled()
            if message is None:
                continue
        if message["type"] == "error":
            raise ApiError(
                400, message["message"], param=message.get("param"), code="invalid_request"
            )
        return message


def _abandon(job: Job, node: str | None) -> None:
    """The client hung up: cancel its job, without waiting (the view is being cancelled).
    `node`: where the stream said it runs, if it said."""
    future = asyncio.get_running_loop().run_in_executor(None, _cancel_abandoned, job, node)
    future.add_done_callback(_log_failed_cancel)


def _log_failed_cancel(future: asyncio.Future) -> None:
    """Nobody awaits the cancel of an abandoned job: say when it failed, or it fails unseen."""
    if not future.cancelled() and future.exception() is not None:
        logger.error("cancel of an abandoned job failed", exc_info=future.exception())


def _cancel_abandoned(job: Job, node: str | None) -> None:
    try:
        if node:
            # Its deltas came from `node`: it runs there, even if the node's own start notice
            # has not reached the control plane yet. Record that start (the notice, when it
            # comes, is then a duplicate), so the cancel stops it there and bills what it made.
            Job.objects.record_started(
                {"request_id": job.request_id, "node": node, "attempt": job.attempts + 1}
            )
        job = Job.objects.select_related("org").filter(pk=job.pk).first()
        if job is not None and job.status not in Job.TERMINAL:
            job.cancel()
    finally:
        close_old_connections()


def _settled_message(job_pk: str) -> dict | None:
    """A `done` or `error` message rebuilt from the job's row, or None while it is unsettled."""
    try:
        job = Job.objects.filter(pk=job_pk).first()
    finally:
        close_old_connections()
    if job is None or job.status not in Job.TERMINAL:
        return None
    if job.status == Job.FAILED:
        return {"type": "error", "message": job.error, "param": None}
    return {"type": "done", "node": job.node, "prefill_node": job.prefill_node, **job.result}


def _with_headers(
    response,
    admission: Admission,
    node: str | None,
    cached: int | None,
    prefill_node: str | None = None,
):
    """The answer's headers: the request id, the rate limits', and what the node said of its
    work: `x-hearth-node`, the node that decoded it; `x-hearth-prefill-node`, the node that
    computed its prompt, only when the request was split."""
    response["x-request-id"] = admission.job.request_id
    for name, value in admission.headers.items():
        response[name] = value
    if node:
        response["x-hearth-node"] = node
    if prefill_node:
        response["x-hearth-prefill-node"] = prefill_node
    if cached is not None:
        response["x-hearth-cached-tokens"] = str(cached)
    return response


class _ChoiceStream:
    """What a stream has relayed of one choice: its text deltas, and its tool calls so far."""

    def __init__(self, reads_tool_calls: bool) -> None:
        self.calls = ToolCallStream() if reads_tool_calls else None
        self.made_calls = 0
        self.sent: list[str] = []


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def _stream(layer, channel: str, deadline: float, admission: Admission, first: dict):
    job, request = admission.job, admission.request
    created = int(job.created.timestamp())

    fingerprint = first.get("system_fingerprint")

    def chunk(**fields) -> bytes:
        body = stream_chunk(
            job.endpoint,
            job.request_id,
            job.model,
            created,
            system_fingerprint=fingerprint,
            **fields,
        )
        if not request.include_usage:
            body.pop("usage")
        return _sse(body)

    async def events() -> AsyncIterator[bytes]:
        answered = False  # the job settled, or the client was told why it will not get it here
        try:
            async for part in relay():
                yield part
            answered = True
        except ApiError as error:
            answered = True
            yield _sse({"error": {"message": error.message, "code": error.code}})
        finally:
            # Cancelled while waiting for the node, or closed while sending: the client is gone.
            if not answered:
                _abandon(job, first.get("node"))

    choices = [_ChoiceStream(parses_tool_calls(job.request)) for _ in range(request.n)]

    def relayed(index: int, text: str, last: bool = False, logprobs=None) -> Iterator[bytes]:
        """Chunks for choice `index`'s `text` (and its tokens' `logprobs`): as it is, or read
        for tool calls when the request offers tools."""
        choice = choices[index]
        if choice.calls is None:
            if text or logprobs:
                yield chunk(text=text, logprobs=logprobs, index=index)
            return
        for event in [*choice.calls.feed(text), *(choice.calls.finish() if last else [])]:
            if event.call is None:
                if event.content:
                    yield chunk(text=event.content, index=index)
                continue
            # OpenAI's incremental shape: the call's id and name first, then its arguments.
            call_id = tool_call_id(job.request_id, choice.made_calls, index)
            yield chunk(
                index=index,
                tool_call={
                    "index": choice.made_calls,
                    "id": call_id,
                    "type": "function",
                    "function": {"name": event.call.name, "arguments": ""},
                },
            )
            yield chunk(
                index=index,
                tool_call={
                    "index": choice.made_calls,
                    "function": {"arguments": event.call.arguments},
                },
            )
            choice.made_calls += 1

    async def relay() -> AsyncIterator[bytes]:
        message = first
        if job.endpoint == Job.CHAT:
            for index in range(request.n):
                yield chunk(text="", first=True, index=index)
        while message["type"] == "delta":
            index = message.get("index", 0)
            if message["text"] or message.get("logprobs"):
                choices[index].sent.append(message["text"])
                for part in relayed(index, message["text"], logprobs=message.get("logprobs")):
                    yield part
            message = await _receive(layer, channel, deadline, job)
        for index, final in enumerate(node_choices(message)):
            # The full text beyond the deltas relayed so far: non-empty only when the last
            # deltas were lost and the answer came from `done` or the job's row. (A lost delta
            # in the middle cannot be repaired in a stream already sent; the job keeps it all.)
            sent_text = "".join(choices[index].sent)
            text = final["text"]
            missing = text[len(sent_text) :] if text.startswith(sent_text) else ""
            for part in relayed(index, missing, last=True):
                yield part
            yield chunk(
                text=None if job.endpoint == Job.CHAT else "",
                engine_finish_reason=final["finish_reason"],
                reason="tool_calls" if choices[index].made_calls else None,
                index=index,
            )
        if request.include_usage:
            yield chunk(usage=message["usage"])
        yield b"data: [DONE]\n\n"

    response = StreamingHttpResponse(events(), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return _with_headers(
        response,
        admission,
        first.get("node"),
        first.get("cached_tokens"),
        first.get("prefill_node"),
    )

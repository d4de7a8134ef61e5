"""Admission of a completion request: everything between the HTTP body and the broker.

One synchronous function, run off the event loop, so each request costs the loop one hop:
authenticate, validate, tokenize with the model's own template, check the context length, pick a
route, refuse at once when `reject_if_busy` finds no room, write the Job (and its `job.queued`
event), enqueue. Every refusal happens before the Job row exists, so bad input writes nothing.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import dramatiq
from django.conf import settings
from django.db import close_old_connections

from controlplane.accounts.authentication import principal_from_header
from controlplane.accounts.models import KeyRejected
from controlplane.billing import budgets
from controlplane.billing.pricing import max_cost
from controlplane.catalog.models import ServedModel
from controlplane.catalog.registry import live_nodes
from controlplane.gateway.errors import ApiError
from controlplane.gateway.group_commit import write_job
from controlplane.gateway.ratelimiting import take_rate_limit
from controlplane.gateway.responses import parses_tool_calls
from controlplane.gateway.routing import Route, choose_route
from controlplane.gateway.tokenization import prompt_token_ids, tokenizer_for
from controlplane.gateway.validation import CompletionRequest, validate_completion_request
from controlplane.jobs.models import Job
from inference.node.keyed_messages import enqueue_keyed
from inference.node.protocol import GENERATE_ACTOR

logger = logging.getLogger(__name__)
# Heartbeats come every 2 s: by then a busy node's free slots have been reported afresh.
RETRY_AFTER_S = 2


@dataclass
class Admission:
    """An admitted request: its job, where it went, and what the caller asked for."""

    job: Job
    request: CompletionRequest
    route: Route
    prompt_tokens: int
    headers: dict[str, str]  # the rate limits' (ratelimiting.py)


def _parse(body: bytes):
    try:
        return json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(
            400, f"The request body is not valid JSON: {error}", code="invalid_json"
        ) from None


def _check_context(request: CompletionRequest, model: ServedModel, prompt_len: int) -> int:
    """The request's max_tokens, defaulting to what the context leaves; 400 when it cannot fit."""
    param = "messages" if request.messages is not None else "prompt"
    room = model.context_length - prompt_len
    if room < 1:
        raise ApiError(
            400,
            f"This model's maximum context length is {model.context_length} tokens; the prompt "
            f"has {prompt_len}.",
            param=param,
            code="context_length_exceeded",
        )
    if request.max_tokens is not None and request.max_tokens > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {model.context_length} tokens; the prompt "
            f"has {prompt_len} and max_tokens asks for {request.max_tokens}.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return request.max_tokens or room


def dispatch(job: Job, queue: str, reply_channel: str | None, deadline: float) -> None:
    """Send the job's generation message to `queue`, under the job's message key."""
    broker = dramatiq.get_broker()
    broker.declare_queue(queue)  # the stub broker refuses undeclared queues; Redis's is a no-op
    message = dramatiq.Message(
        queue_name=queue,
        actor_name=GENERATE_ACTOR,
        args=(job.generation_message(reply_channel, deadline),),
        kwargs={},
        options={},
    )
    enqueue_keyed(broker, message, job.message_key())


def admit(
    authorization: str,
    body: bytes,
    endpoint: str,
    session_affinity: str | None,
    reply_channel: str | None,
) -> Admission:
    """Admit one request or raise ApiError; see the module docstring for the steps."""
    try:
        return _admit(authorization, body, endpoint, session_affinity, reply_channel)
    finally:
        close_old_connections()  # hands the connection back to the pool; this is no request thread


def _admit(authorization, body, endpoint, session_affinity, reply_channel) -> Admission:
    try:
        principal = principal_from_header(authorization)
    except KeyRejected as rejected:
        raise ApiError(401, str(rejected), code=rejected.code) from None
    parsed = _parse(body)
    prepared = prepare_request(parsed, endpoint)
    request = prepared.request
    headers = take_rate_limit(
        principal.api_key, len(prepared.prompt_token_ids) + prepared.max_completion_tokens
    )
    route = choose_route(
        prepared.model.id,
        live_nodes(prepared.model.id),
        session_affinity,
        prepared.prompt_token_ids,
        namespace=principal.org.slug,  # the node's cache namespace (Job.generation_message)
    )
    if request.reject_if_busy and not route.has_room:
        raise ApiError(
            429,
            "No node serving this model has room for the request now; retry later, or leave "
            "out reject_if_busy to wait in the queue.",
            code="out_of_capacity",
            headers={"retry-after": str(RETRY_AFTER_S)},
        )
    # A queued job may wait up to its deadline (24 h unless it says); a synchronous one no longer
    # than the gateway waits for it.
    window = (
        request.deadline_s or settings.JOB_DEADLINE_S
        if request.queue
        else min(
            request.deadline_s or settings.SYNC_REQUEST_TIMEOUT_S, settings.SYNC_REQUEST_TIMEOUT_S
        )
    )
    deadline = time.time() + window
    job = submit_prepared(
        prepared,
        principal,
        endpoint,
        mode=Job.ASYNC if request.queue else Job.SYNC,
        deadline=deadline,
        session_affinity=session_affinity or "",
        queue=route.queue,
        route=route.decision,
    )
    enqueue_job(job, route, None if request.queue else reply_channel, deadline)
    return Admission(
        job=job,
        request=request,
        route=route,
        prompt_tokens=len(prepared.prompt_token_ids),
        headers=headers,
    )


@dataclass
class PreparedRequest:
    """A validated, tokenized request that fits its model's context: everything a Job needs."""

    body: dict
    request: CompletionRequest
    model: ServedModel
    prompt_token_ids: list[int]
    sampling: dict

    @property
    def max_completion_tokens(self) -> int:
        """The most it may generate: max_tokens for each of its n choices."""
        return self.sampling["max_tokens"] * self.sampling.get("n", 1)


def prepare_request(body: Any, endpoint: str) -> PreparedRequest:
    """Validate a parsed body for `endpoint` ("chat.completions" or "completions"), find its
    model, tokenize it with the model's own template and check the context; ApiError otherwise.
    The completion views and each line of a batch go through this same step."""
    request = validate_completion_request(body, endpoint)
    model = ServedModel.objects.enabled(request.model)
    if model is None:
        raise ApiError(
            404, f"The model '{request.model}' does not exist.", "model", "model_not_found"
        )
    tokenizer = tokenizer_for(model.source)
    offered = request.tools if parses_tool_calls(body) else None
    token_ids = prompt_token_ids(tokenizer, request.messages, request.prompt, offered)
    bias = request.sampling.get("logit_bias") or {}
    if any(int(token) >= tokenizer.vocab_size for token in bias):
        raise ApiError(
            400,
            f"'logit_bias' names a token id outside the vocabulary [0, {tokenizer.vocab_size}).",
            "logit_bias",
            "invalid_value",
        )
    max_tokens = _check_context(request, model, len(token_ids))
    sampling = {"temperature": 1.0, **request.sampling, "max_tokens": max_tokens}
    return PreparedRequest(body, request, model, token_ids, sampling)


def submit_prepared(
    prepared: PreparedRequest,
    principal,
    endpoint: str,
    mode: str,
    deadline: float,
    **fields: Any,
) -> Job:
    """The queued Job (and its `job.queued` event) for a prepared request, with its maximum cost
    reserved in the budgets that limit it (billing/budgets.py); ApiError 402 `budget_exceeded`
    when it does not fit, and then nothing is written. Written with the process's other
    admissions of the moment (group_commit.py)."""
    job = Job(
        org=principal.org,
        api_key=principal.api_key,
        model=prepared.model.id,
        mode=mode,
        endpoint=endpoint,
        request=prepared.body,
        prompt_token_ids=prepared.prompt_token_ids,
        sampling=prepared.sampling,
        deadline_at=datetime.fromtimestamp(deadline, tz=UTC),
        **fields,
    )
    cost = None
    if budgets.limited_scopes(principal.org, principal.api_key):
        price = prepared.model.current_price()
        cost = max_cost(
            price,
            len(prepared.prompt_token_ids),
            prepared.max_completion_tokens,
            Job.discount_percent(price, mode),
        )
    return write_job(job, cost)


def enqueue_job(job: Job, route: Route, reply_channel: str | None, deadline: float) -> None:
    """Send the job's generation message to its route; a broker that refuses it fails the job
    and answers 503."""
    if job.queue != route.queue:  # a batch's jobs are written before their routes are chosen
        job.queue = route.queue
        Job.objects.filter(pk=job.pk).update(queue=route.queue)
    try:
        dispatch(job, route.queue, reply_channel, deadline)
    except Exception as error:
        logger.exception("enqueue of %s failed", job.id)
        job.fail(f"the broker refused the request: {error}")
        raise ApiError(
            503, "The request could not be queued; try again.", code="broker_unavailable"
        ) from error

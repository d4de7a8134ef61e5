"""Admission of a completion request: everything between the HTTP body and the broker.

One synchronous function, run off the event loop, so each request costs the loop one hop:
authenticate, validate, tokenize with the model's own template, check the context length, pick a
route, refuse at once when `reject_if_busy` finds no room, decide whether a prefill node computes
the prompt (disaggregation.py), write the Job (and its `job.queued` event), enqueue. Every
refusal happens before the Job row exists, so bad input writes nothing.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import close_old_connections

from controlplane.api.auth import ApiKeyPrincipal, authenticate
from controlplane.api.errors import ApiError
from controlplane.billing import budgets
from controlplane.billing.pricing import max_cost
from controlplane.catalog.registry import live_nodes
from controlplane.dispatch.disaggregation import split
from controlplane.dispatch.enqueue import enqueue_job
from controlplane.dispatch.group_commit import write_job
from controlplane.dispatch.preparing import PreparedRequest, prepare_request
from controlplane.dispatch.ratelimiting import take_rate_limit
from controlplane.dispatch.routing import Route, choose_route
from controlplane.dispatch.validation import CompletionRequest
from controlplane.jobs.models import Job

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


def admit(
    authorization: str | ApiKeyPrincipal,
    body: bytes,
    endpoint: str,
    session_affinity: str | None,
    reply_channel: str | None,
) -> Admission:
    """Admit one request or raise ApiError; see the module docstring for the steps.
    `authorization`: the `Authorization` header, or the principal when the caller acts through
    a key it holds without its secret (the console playground: console/playground.py)."""
    try:
        return _admit(authorization, body, endpoint, session_affinity, reply_channel)
    finally:
        close_old_connections()  # hands the connection back to the pool; this is no request thread


def _admit(authorization, body, endpoint, session_affinity, reply_channel) -> Admission:
    principal = (
        authorization if isinstance(authorization, ApiKeyPrincipal) else authenticate(authorization)
    )
    parsed = _parse(body)
    prepared = prepare_request(parsed, endpoint)
    request = prepared.request
    headers = take_rate_limit(
        principal.api_key, len(prepared.prompt_token_ids) + prepared.max_completion_tokens
    )
    nodes = live_nodes(prepared.model.id)
    route = choose_route(
        prepared.model.id,
        nodes,
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
    route = split(prepared.model.id, nodes, route, prepared.prompt_token_ids, principal.org.slug)
    job = submit_prepared(
        prepared,
        principal,
        endpoint,
        mode=Job.ASYNC if request.queue else Job.SYNC,
        deadline=deadline,
        session_affinity=session_affinity or "",
        queue=route.queue,
        route=route.decision,
        prefill_queue=route.prefill_queue or "",
    )
    enqueue_job(job, route, None if request.queue else reply_channel, deadline)
    return Admission(
        job=job,
        request=request,
        route=route,
        prompt_tokens=len(prepared.prompt_token_ids),
        headers=headers,
    )


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

"""One job's page: its request as received, its response, the timeline of its events, what it was
charged and at which price, where and how often it ran, how long it took, its webhook
deliveries; and a Cancel button, which does what `POST /v1/jobs/{id}/cancel` does.

Another org's job is a 404. The page's script re-reads it when an event of the job arrives over
/ws/events, so a job's status and timeline change without a reload.
"""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import path
from django.views.decorators.http import require_GET, require_POST

from controlplane.api.responses import (
    completion_response,
    epoch_seconds,
    node_choices,
    parses_tool_calls,
)
from controlplane.billing.models import UsageRecord
from controlplane.billing.pricing import decimal_string
from controlplane.console.roles import console_view
from controlplane.events.models import Event
from controlplane.events.webhooks import WebhookDelivery
from controlplane.jobs.models import Job

# What the request body holds besides its prompt: shown as its parameters.
PROMPT_FIELDS = ("messages", "prompt")


def pretty(value: Any) -> str:
    """JSON as a person reads it."""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


def request_view(job: Job) -> dict[str, Any]:
    """The request as received (validated by the gateway): its messages (chat) or prompt
    (completions), and its other fields, the parameters."""
    body = job.request or {}
    messages = []
    for message in body.get("messages") or []:
        content = message.get("content")
        extra = {k: v for k, v in message.items() if k not in ("role", "content")}
        messages.append(
            {
                "role": message.get("role", ""),
                "text": content if isinstance(content, str) else None,
                # Content parts, or none (an assistant turn of tool calls): shown as JSON.
                "json": None if isinstance(content, str) or content is None else pretty(content),
                "extra": pretty(extra) if extra else None,
            }
        )
    prompt = body.get("prompt")
    return {
        "messages": messages,
        "prompt": prompt if isinstance(prompt, str) or prompt is None else pretty(prompt),
        "parameters": pretty({k: v for k, v in body.items() if k not in PROMPT_FIELDS}),
        "sampling": pretty(job.sampling or {}),
    }


def response_view(job: Job) -> dict[str, Any] | None:
    """The completion the job's result makes (a cancelled job's, too: what it generated before
    it stopped), as the API would answer it; None before there is one."""
    if not job.result or "usage" not in job.result:
        return None
    response = completion_response(
        job.endpoint,
        job.request_id,
        job.model,
        epoch_seconds(job.created),
        job.result,
        tool_calls=parses_tool_calls(job.request or {}),
    )
    choices = []
    # The node's own logprob entries ({token, logprob, top_logprobs}) are the same for both
    # endpoints; the response reshapes them for completions.
    for choice, reported in zip(response["choices"], node_choices(job.result), strict=True):
        message = choice.get("message") or {}
        choices.append(
            {
                "index": choice["index"],
                "finish_reason": choice["finish_reason"],
                "text": message.get("content") if job.endpoint == Job.CHAT else choice["text"],
                "tool_calls": [
                    {
                        "id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": call["function"]["arguments"],
                    }
                    for call in message.get("tool_calls") or []
                ],
                "logprobs": reported.get("logprobs"),
            }
        )
    return {"id": response["id"], "choices": choices, "usage": response["usage"]}


def timeline(events: list[Event]) -> list[dict[str, Any]]:
    """The job's events, oldest first, each with what it changed."""
    return [
        {
            "id": event.id,
            "type": event.type,
            "created": event.created,
            "status": event.data.get("status"),
            "node": event.data.get("node"),
            "attempts": event.data.get("attempts"),
        }
        for event in events
    ]


def charge(job: Job, record: UsageRecord | None) -> dict[str, Any] | None:
    """What the job was charged (its result's `cost`) and the price it was charged at (its usage
    row's: USD per 1M tokens, and the async discount it got); None when nothing was billed."""
    cost = (job.result or {}).get("cost")
    if cost is None:
        return None
    price = None
    if record is not None:
        price = {
            "input": decimal_string(record.price.input_per_mtok),
            "cached_input": decimal_string(record.price.cached_input_per_mtok),
            "output": decimal_string(record.price.output_per_mtok),
            "discount_percent": record.discount_percent,
        }
    return {"cost": cost, "price": price, "record": record}


def org_job(request: HttpRequest, job_id: str) -> Job:
    """The job of the user's org, or a 404."""
    return get_object_or_404(
        Job.objects.select_related("org", "api_key"), id=job_id, org=request.org
    )


@require_GET
@console_view("jobs")
def job(request: HttpRequest, job_id: str) -> HttpResponse:
    """The job's page; its events are the org's whose data is this job (job_object's `id`)."""
    job = org_job(request, job_id)
    if job.status == Job.QUEUED:  # as the API reads it: never queued past its deadline
        Job.objects.expire_overdue(org=request.org)
        job.refresh_from_db()
    events = list(Event.objects.filter(org=request.org, data__id=job.id).order_by("sequence"))
    deliveries = (
        WebhookDelivery.objects.filter(event__in=[event.pk for event in events])
        .select_related("endpoint", "event")
        .order_by("event__sequence", "endpoint_id", "attempt")
    )
    record = (
        UsageRecord.objects.select_related("price")
        .filter(request_id=job.request_id, org=request.org)
        .first()
    )
    context = {
        "job": job,
        "request_view": request_view(job),
        "response": response_view(job),
        "timeline": timeline(events),
        "charge": charge(job, record),
        "deliveries": list(deliveries),
        "cancellable": job.status in (Job.QUEUED, Job.RUNNING) and job.cancel_requested_at is None,
    }
    return render(request, "console/job.html", context)


@require_POST
@console_view("cancel_job")
def cancel(request: HttpRequest, job_id: str) -> HttpResponse:
    """Cancel the job as the API does (Job.cancel: a settled job, or one whose cancel was already
    asked, is left as it is), then show it."""
    org_job(request, job_id).cancel()
    return redirect("console:job", job_id=job_id)


urlpatterns = [
    path("jobs/<str:job_id>", job, name="job"),
    path("jobs/<str:job_id>/cancel", cancel, name="cancel-job"),
]

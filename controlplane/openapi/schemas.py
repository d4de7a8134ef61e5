"""Component schemas of Hearth's OpenAPI document: OpenAI's, from the vendored subset of its
published spec, and Hearth's own objects and extensions. Hearth's additions to an OpenAI object
are extra properties (`allOf` with OpenAI's schema), never changed ones."""

from __future__ import annotations

import copy
import json
from functools import cache
from typing import Any

from controlplane.dispatch.validation import MAX_DEADLINE_S
from controlplane.events.webhooks import EVENT_TYPES
from controlplane.openapi.vendor import SUBSET_PATH


def ref(name: str) -> dict[str, str]:
    """A reference to component schema `name`."""
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


@cache
def openai_schemas() -> dict[str, Any]:
    """OpenAI's component schemas that Hearth's document uses (controlplane/openapi/vendor.py)."""
    return json.loads(SUBSET_PATH.read_text())["schemas"]


STRING, INTEGER, BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
UNIX_SECONDS = {"type": "integer", "description": "Unix time, in seconds."}
DECIMAL_USD = {
    "type": "string",
    "pattern": r"^-?[0-9]+(\.[0-9]+)?$",
    "description": "An exact decimal amount in USD, as a string: money never passes a float.",
}


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra) -> dict:
    """An object schema requiring every property unless `required` says otherwise."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        **extra,
    }


def list_of(item: dict, paged: bool = False) -> dict:
    """`{object: "list", data}`, with OpenAI's cursor fields when `paged`. On an empty page
    `first_id` and `last_id` are null, as OpenAI's API answers (its spec types them as strings)."""
    properties: dict[str, Any] = {"object": {"type": "string", "enum": ["list"]}}
    properties["data"] = {"type": "array", "items": item}
    if paged:
        properties["first_id"] = nullable(STRING)
        properties["last_id"] = nullable(STRING)
        properties["has_more"] = BOOLEAN
    return obj(properties)


HEARTH_REQUEST_FIELDS = {
    "type": "object",
    "description": "Hearth's extensions of OpenAI's completion requests.",
    "properties": {
        "queue": {
            "type": ["boolean", "null"],
            "description": "Answer 202 with a job at once and run the request asynchronously; "
            "its result is on the job (`GET /v1/jobs/{id}`) and in `job.completed` events.",
        },
        "reject_if_busy": {
            "type": ["boolean", "null"],
            "description": "Fail at once with 429 `out_of_capacity` (and `retry-after`) "
            "instead of waiting in the queue when no node has room.",
        },
        "deadline_s": {
            "type": ["integer", "null"],
            "minimum": 1,
            "maximum": MAX_DEADLINE_S,
            "description": "Seconds from submission after which the job is expired.",
        },
        "top_k": {"type": ["integer", "null"], "minimum": 0},
        "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 10},
    },
}

COST = obj(
    {
        "currency": {"type": "string", "enum": ["USD"]},
        "input": DECIMAL_USD,
        "cached_input": DECIMAL_USD,
        "output": DECIMAL_USD,
        "total": DECIMAL_USD,
        "cache_savings": DECIMAL_USD,
    }
)

JOB = obj(
    {
        "id": {"type": "string", "pattern": "^job_"},
        "object": {"type": "string", "enum": ["job"]},
        "status": {
            "type": "string",
            "enum": ["queued", "running", "completed", "failed", "cancelled", "expired"],
        },
        "model": STRING,
        "mode": {"type": "string", "enum": ["sync", "async", "batch"]},
        "endpoint": {"type": "string", "enum": ["/v1/chat/completions", "/v1/completions"]},
        "request_id": STRING,
        "created": UNIX_SECONDS,
        "started_at": nullable(UNIX_SECONDS),
        "finished_at": nullable(UNIX_SECONDS),
        "node": nullable(STRING),
        "prefill_node": {
            "type": ["string", "null"],
            "description": "The node that computed the prompt when the request was split "
            "between a prefill and a decode node (`node` then decoded it); null otherwise.",
        },
        "attempts": {"type": "integer", "minimum": 0},
        "usage": nullable(ref("CompletionUsage")),
        "cost": nullable(ref("Cost")),
        "response": {
            "description": "A completed job's completion: what the request would have answered "
            "synchronously.",
            "anyOf": [
                ref("CreateChatCompletionResponse"),
                ref("CreateCompletionResponse"),
                {"type": "null"},
            ],
        },
        "deadline_at": nullable(UNIX_SECONDS),
        "cancel_requested_at": nullable(UNIX_SECONDS),
        "error": nullable(obj({"message": STRING, "code": STRING})),
        "queue_position": {
            "type": ["integer", "null"],
            "description": "Queued jobs of the same model ahead of this one (null unless queued).",
        },
        "estimated_start_s": {"type": ["number", "null"]},
    },
    # Admission's 202 answers the job without the queue estimate.
    required=[
        "id",
        "object",
        "status",
        "model",
        "mode",
        "endpoint",
        "request_id",
        "created",
        "usage",
        "cost",
        "response",
        "error",
    ],
)

PRICING = obj(
    {
        "input": DECIMAL_USD,
        "cached_input": DECIMAL_USD,
        "output": DECIMAL_USD,
        "unit": {"type": "string", "enum": ["USD per 1M tokens"]},
        "async_discount_percent": {"type": "integer", "minimum": 0, "maximum": 100},
    }
)

HEARTH_MODEL = {
    "allOf": [
        ref("Model"),
        obj(
            {
                "context_length": {"type": "integer", "minimum": 1},
                "pricing": nullable(ref("ModelPricing")),
            }
        ),
    ]
}

EVENT = obj(
    {
        "id": {"type": "string", "pattern": "^evt_"},
        "object": {"type": "string", "enum": ["event"]},
        "type": {"type": "string", "enum": list(EVENT_TYPES)},
        "created": UNIX_SECONDS,
        "data": {"type": "object", "description": "The job or batch object, as it became."},
    }
)

WEBHOOK_ENDPOINT = obj(
    {
        "id": {"type": "string", "pattern": "^we_"},
        "object": {"type": "string", "enum": ["webhook_endpoint"]},
        "url": STRING,
        "event_types": {
            "type": "array",
            "items": {"type": "string", "enum": list(EVENT_TYPES)},
            "description": "Empty: every event.",
        },
        "description": STRING,
        "enabled": BOOLEAN,
        "disabled_reason": nullable(STRING),
        "created": UNIX_SECONDS,
    }
)

WEBHOOK_DELIVERY = obj(
    {
        "id": STRING,
        "object": {"type": "string", "enum": ["webhook_delivery"]},
        "endpoint_id": STRING,
        "event_id": STRING,
        "event_type": STRING,
        "attempt": {"type": "integer", "minimum": 1},
        "status": {"type": "string", "enum": ["pending", "sending", "succeeded", "failed"]},
        "response_status_code": nullable(INTEGER),
        "response_body": nullable(STRING),
        "error": nullable(STRING),
        "duration_ms": nullable(INTEGER),
        "created": UNIX_SECONDS,
        "scheduled_at": nullable(UNIX_SECONDS),
        "next_attempt_at": nullable(UNIX_SECONDS),
    }
)

USAGE_TOTALS = obj(
    {
        "requests": INTEGER,
        "prompt_tokens": INTEGER,
        "cached_tokens": INTEGER,
        "completion_tokens": INTEGER,
        "cache_hit_ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "cost": ref("Cost"),
    }
)

USAGE_REPORT = obj(
    {
        "object": {"type": "string", "enum": ["usage_report"]},
        "start": {"type": "string", "format": "date-time"},
        "end": {"type": "string", "format": "date-time"},
        "group_by": {"type": "string", "enum": ["day", "model", "key"]},
        "data": {
            "type": "array",
            "description": "One row per group: `day`, `model`, or the key's `api_key_id`, "
            "`api_key_name` and `api_key_prefix` (null for a deleted key), with its totals.",
            "items": {
                "allOf": [
                    ref("UsageTotals"),
                    {
                        "type": "object",
                        "properties": {
                            "day": {"type": "string", "format": "date"},
                            "model": STRING,
                            "api_key_id": nullable(INTEGER),
                            "api_key_name": nullable(STRING),
                            "api_key_prefix": nullable(STRING),
                        },
                    },
                ]
            },
        },
        "total": ref("UsageTotals"),
    }
)

INVOICE = obj(
    {
        "id": STRING,
        "object": {"type": "string", "enum": ["invoice"]},
        "status": {"type": "string", "enum": ["draft", "final"]},
        "currency": {"type": "string", "enum": ["USD"]},
        "period_start": {"type": "string", "format": "date"},
        "period_end": {"type": "string", "format": "date"},
        "requests": INTEGER,
        "lines": {
            "type": "array",
            "items": obj(
                {
                    "model": STRING,
                    "kind": {"type": "string", "enum": ["input", "cached_input", "output"]},
                    "quantity": INTEGER,
                    "unit_price": DECIMAL_USD,
                    "unit": {"type": "string", "enum": ["USD per 1M tokens"]},
                    "amount": DECIMAL_USD,
                }
            ),
        },
        "subtotal": DECIMAL_USD,
        "total": DECIMAL_USD,
        "amount_due": DECIMAL_USD,
        "cache_savings": DECIMAL_USD,
        "created": UNIX_SECONDS,
        "finalized_at": nullable(UNIX_SECONDS),
    }
)

_LIMITED_USE = {
    "monthly_budget_usd": nullable(DECIMAL_USD),
    "spent_usd": nullable(DECIMAL_USD),
    "reserved_usd": nullable(DECIMAL_USD),
}
KEY_LIMITS = obj(
    {
        "object": {"type": "string", "enum": ["api_key.limits"]},
        "id": {"type": "string", "description": "The key's public prefix."},
        "name": STRING,
        **_LIMITED_USE,
        "requests_per_minute": nullable(INTEGER),
        "tokens_per_minute": nullable(INTEGER),
    }
)
BUDGET = obj(
    {
        "object": {"type": "string", "enum": ["budget"]},
        "month": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"},
        **_LIMITED_USE,
        "keys": {"type": "array", "items": ref("ApiKeyLimits")},
    }
)
BUDGET_AMOUNT = {
    "description": "USD, zero or more, at most 6 decimal places; null for no limit.",
    "anyOf": [{"type": "string"}, {"type": "number", "minimum": 0}, {"type": "null"}],
}
RATE = {"type": ["integer", "null"], "minimum": 1, "maximum": 2**31 - 1}


def _sse_event(payload: dict[str, Any], description: str) -> dict[str, Any]:
    """One Server-Sent Event whose `data` is JSON matching `payload`, or the final `[DONE]`."""
    return {
        "type": "object",
        "description": description,
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "if": {"const": "[DONE]"},
                "then": True,
                "else": {"contentMediaType": "application/json", "contentSchema": payload},
            }
        },
    }


STREAM_ERROR = obj(
    {"error": obj({"message": STRING, "code": nullable(STRING)})},
    description="Sent in place of further chunks when the request fails after the stream began.",
)


def completion_stream_chunk() -> dict[str, Any]:
    """A streamed `text_completion` chunk. OpenAI's spec gives streamed chunks the response's
    schema, but its API (and Hearth) sends `finish_reason: null` until the last chunk, and
    `usage: null` before the usage chunk that `stream_options.include_usage` asks for."""
    chunk = copy.deepcopy(openai_schemas()["CreateCompletionResponse"])
    chunk["description"] = completion_stream_chunk.__doc__.split(". ", 1)[0] + "."
    choice = chunk["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {
        "enum": [*choice["finish_reason"]["enum"], None],
        "description": "null until the last chunk.",
    }
    chunk["properties"]["usage"] = nullable(ref("CompletionUsage"))
    return chunk


def hearth_schemas() -> dict[str, Any]:
    """Hearth's own component schemas."""
    return {
        "HearthCompletionFields": HEARTH_REQUEST_FIELDS,
        "HearthChatCompletionRequest": {
            "allOf": [ref("CreateChatCompletionRequest"), ref("HearthCompletionFields")]
        },
        "HearthCompletionRequest": {
            "allOf": [ref("CreateCompletionRequest"), ref("HearthCompletionFields")]
        },
        "StreamError": STREAM_ERROR,
        "ChatCompletionStreamEvent": _sse_event(
            {"anyOf": [ref("CreateChatCompletionStreamResponse"), ref("StreamError")]},
            "A chunk (`chat.completion.chunk`), an error, or `[DONE]`.",
        ),
        "CompletionStreamChunk": completion_stream_chunk(),
        "CompletionStreamEvent": _sse_event(
            {"anyOf": [ref("CompletionStreamChunk"), ref("StreamError")]},
            "A `text_completion` chunk, an error, or `[DONE]`.",
        ),
        "Cost": COST,
        "Job": JOB,
        "JobList": list_of(ref("Job"), paged=True),
        "ModelPricing": PRICING,
        "HearthModel": HEARTH_MODEL,
        "HearthModelList": list_of(ref("HearthModel")),
        "FileList": list_of(ref("OpenAIFile"), paged=True),
        "BatchList": list_of(ref("Batch"), paged=True),
        "Event": EVENT,
        "EventStreamEvent": {
            "type": "object",
            "description": "One Server-Sent Event: `id` (resume from it), `event` (its type) "
            "and `data`, the event object.",
            "required": ["data"],
            "properties": {
                "id": STRING,
                "event": STRING,
                "data": {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": ref("Event"),
                },
            },
        },
        "WebhookEndpoint": WEBHOOK_ENDPOINT,
        "WebhookEndpointWithSecret": {
            "allOf": [
                ref("WebhookEndpoint"),
                obj({"secret": {"type": "string", "pattern": "^whsec_"}}),
            ],
            "description": "Only creation and rotation show the signing secret.",
        },
        "WebhookEndpointList": list_of(ref("WebhookEndpoint")),
        "CreateWebhookEndpointRequest": obj(
            {
                "url": {"type": "string", "format": "uri"},
                "event_types": {"type": "array", "items": {"enum": list(EVENT_TYPES)}},
                "description": {"type": "string", "maxLength": 512},
            },
            required=["url"],
        ),
        "DeletedWebhookEndpoint": obj(
            {
                "id": STRING,
                "object": {"type": "string", "enum": ["webhook_endpoint"]},
                "deleted": {"type": "boolean", "enum": [True]},
            }
        ),
        "WebhookDelivery": WEBHOOK_DELIVERY,
        "WebhookDeliveryList": obj(
            {
                "object": {"type": "string", "enum": ["list"]},
                "data": {"type": "array", "items": ref("WebhookDelivery")},
                "has_more": BOOLEAN,
            }
        ),
        "UsageTotals": USAGE_TOTALS,
        "UsageReport": USAGE_REPORT,
        "Invoice": INVOICE,
        "InvoiceList": list_of(ref("Invoice")),
        "ApiKeyLimits": KEY_LIMITS,
        "Budget": BUDGET,
        "UpdateBudgetRequest": obj(
            {"monthly_budget_usd": BUDGET_AMOUNT}, additionalProperties=False
        ),
        "UpdateApiKeyLimitsRequest": obj(
            {
                "monthly_budget_usd": BUDGET_AMOUNT,
                "requests_per_minute": RATE,
                "tokens_per_minute": RATE,
            },
            required=[],
            additionalProperties=False,
        ),
        "Health": obj({"status": {"type": "string", "enum": ["ok"]}}),
    }

"""What introspection cannot say about each operation: its request, its responses and its
errors, keyed by (path, method) as the document names them.

`hooks.describe_api` lays each entry over the operation drf-spectacular generated (the DRF views),
or adds it (the async views: completions, the event stream, health). An operation in the URLconf
without an entry here fails the document's build, so a new endpoint cannot go undocumented.
"""

from __future__ import annotations

from typing import Any

from controlplane.gateway.pagination import MAX_LIMIT
from controlplane.openapi.schemas import JOB, ref

# Every error is OpenAI's ErrorResponse; these say when each status comes.
ERROR_DESCRIPTIONS = {
    400: "Invalid request: `param` names the field, `code` says what is wrong.",
    401: "Missing, malformed, unknown, revoked or expired API key.",
    402: "The request's maximum cost exceeds the org's or the key's monthly budget "
    "(`budget_exceeded`).",
    404: "Not found, or another organization's (never a 403).",
    405: "Method not allowed.",
    409: "Idempotency-Key conflict: another body, in use, or a stream that cannot be replayed.",
    429: "Rate limited (`rate_limit_exceeded`), or no capacity with `reject_if_busy` "
    "(`out_of_capacity`); `retry-after` says when to retry.",
    503: "The broker is unreachable (`broker_unavailable`); nothing was queued.",
    504: "No answer within the synchronous timeout; the job stays queued.",
}


def errors(*statuses: int) -> dict[str, Any]:
    return {str(status): {"$ref": f"#/components/responses/Error{status}"} for status in statuses}


def json_body(schema: dict, description: str = "OK", **extra) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": schema}},
        **extra,
    }


def query(name: str, schema: dict, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "schema": schema,
        "description": description,
    }


LIMIT = query(
    "limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}, "Page size (default 20)."
)
AFTER = query("after", {"type": "string"}, "An id from the previous page: the page after it.")
COMPLETION_HEADERS = {
    "x-request-id": {"$ref": "#/components/headers/x-request-id"},
    "x-hearth-node": {"$ref": "#/components/headers/x-hearth-node"},
    "x-hearth-prefill-node": {"$ref": "#/components/headers/x-hearth-prefill-node"},
    "x-hearth-cached-tokens": {"$ref": "#/components/headers/x-hearth-cached-tokens"},
}
COMPLETION_PARAMETERS = [
    {"$ref": "#/components/parameters/x-session-affinity"},
    {"$ref": "#/components/parameters/Idempotency-Key"},
]
PUBLIC: list = []  # no `security`: open without a key


def examples(**named: dict) -> dict[str, Any]:
    """A media type's `examples`: request bodies a client may send as they are."""
    return {name: {"value": value} for name, value in named.items()}


MODEL = "SmolLM2-135M-Instruct"
CHAT_EXAMPLES = examples(
    plain={
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    },
    streamed={
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Name a colour."},
        ],
        "max_completion_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "top_k": 20,
        "stop": ["\n"],
    },
    queued={
        "model": MODEL,
        "messages": [{"role": "user", "content": "Summarise the news."}],
        "max_tokens": 8,
        "queue": True,
        "deadline_s": 3600,
    },
)
TEXT_EXAMPLES = examples(
    plain={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "seed": 7},
    streamed={"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 8, "stream": True},
)


def _completion(
    kind: str, request: str, response: str, stream_event: str, request_examples: dict
) -> dict[str, Any]:
    return {
        "operationId": f"create{kind}",
        "tags": ["Completions"],
        "summary": f"Create a {'chat ' if kind == 'ChatCompletion' else ''}completion",
        "description": "OpenAI's endpoint, with Hearth's extensions (`queue`, `reject_if_busy`, "
        "`deadline_s`, `top_k`, `min_p`, `repetition_penalty`). Synchronous requests wait in "
        "the queue for capacity; `stream: true` answers Server-Sent Events ending with "
        "`data: [DONE]`; `queue: true` answers 202 with a job. Fields that are not supported "
        "yet are refused with a 400 naming them (`code: unsupported`).",
        "parameters": COMPLETION_PARAMETERS,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ref(request), "examples": request_examples}},
        },
        "responses": {
            "200": {
                "description": "The completion, or with `stream: true` its chunks as SSE.",
                "headers": COMPLETION_HEADERS,
                "content": {
                    "application/json": {"schema": ref(response)},
                    "text/event-stream": {"schema": ref(stream_event)},
                },
            },
            "202": json_body(
                ref("Job"),
                "`queue: true`: the job, queued.",
                headers={"x-request-id": {"$ref": "#/components/headers/x-request-id"}},
            ),
            **errors(400, 401, 402, 404, 405, 409, 429, 503, 504),
        },
    }


OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("/healthz", "get"): {
        "operationId": "health",
        "tags": ["Operations"],
        "summary": "Health check",
        "security": PUBLIC,
        "responses": {"200": json_body(ref("Health"))},
    },
    ("/metrics", "get"): {
        "operationId": "metrics",
        "tags": ["Operations"],
        "summary": "Route counters in Prometheus's text format (for the operator's network)",
        "security": PUBLIC,
        "responses": {
            "200": {
                "description": "`hearth_route_{requests,prompt_tokens,cached_tokens}_total`, by "
                "model and route decision.",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    },
    ("/v1/models", "get"): {
        "operationId": "listModels",
        "tags": ["Models"],
        "summary": "List the served models, with context length and prices",
        "responses": {"200": json_body(ref("HearthModelList")), **errors(401)},
    },
    ("/v1/models/{model_id}", "get"): {
        "operationId": "retrieveModel",
        "tags": ["Models"],
        "summary": "Retrieve a model",
        "responses": {"200": json_body(ref("HearthModel")), **errors(401, 404)},
    },
    ("/v1/chat/completions", "post"): _completion(
        "ChatCompletion",
        "HearthChatCompletionRequest",
        "CreateChatCompletionResponse",
        "ChatCompletionStreamEvent",
        CHAT_EXAMPLES,
    ),
    ("/v1/completions", "post"): _completion(
        "Completion",
        "HearthCompletionRequest",
        "CreateCompletionResponse",
        "CompletionStreamEvent",
        TEXT_EXAMPLES,
    ),
    ("/v1/jobs", "get"): {
        "operationId": "listJobs",
        "tags": ["Jobs"],
        "summary": "List the org's jobs, newest first",
        "parameters": [
            LIMIT,
            AFTER,
            query("status", JOB["properties"]["status"], "Only jobs in this status."),
        ],
        "responses": {"200": json_body(ref("JobList")), **errors(400, 401)},
    },
    ("/v1/jobs/{job_id}", "get"): {
        "operationId": "retrieveJob",
        "tags": ["Jobs"],
        "summary": "Retrieve a job (a queued one with its queue position)",
        "responses": {"200": json_body(ref("Job")), **errors(401, 404)},
    },
    ("/v1/jobs/{job_id}/cancel", "post"): {
        "operationId": "cancelJob",
        "tags": ["Jobs"],
        "summary": "Cancel a job",
        "description": "A queued job is cancelled at once; a running one is stopped on its node "
        "and billed for what it generated. A settled job is returned unchanged.",
        "responses": {"200": json_body(ref("Job")), **errors(401, 404)},
    },
    ("/v1/files", "get"): {
        "operationId": "listFiles",
        "tags": ["Files"],
        "summary": "List the org's files, newest first",
        "parameters": [LIMIT, AFTER, query("purpose", {"type": "string"}, "Only this purpose.")],
        "responses": {"200": json_body(ref("FileList")), **errors(400, 401)},
    },
    ("/v1/files", "post"): {
        "operationId": "createFile",
        "tags": ["Files"],
        "summary": "Upload a batch input file (JSONL, checked line by line)",
        "requestBody": {
            "required": True,
            "content": {"multipart/form-data": {"schema": ref("CreateFileRequest")}},
        },
        "responses": {"200": json_body(ref("OpenAIFile")), **errors(400, 401)},
    },
    ("/v1/files/{file_id}", "get"): {
        "operationId": "retrieveFile",
        "tags": ["Files"],
        "summary": "Retrieve a file",
        "responses": {"200": json_body(ref("OpenAIFile")), **errors(401, 404)},
    },
    ("/v1/files/{file_id}", "delete"): {
        "operationId": "deleteFile",
        "tags": ["Files"],
        "summary": "Delete a file",
        "responses": {"200": json_body(ref("DeleteFileResponse")), **errors(401, 404)},
    },
    ("/v1/files/{file_id}/content", "get"): {
        "operationId": "downloadFile",
        "tags": ["Files"],
        "summary": "The file's bytes (JSON Lines), whatever the Accept header",
        "responses": {
            "200": {
                "description": "The file as uploaded or written.",
                "content": {"application/jsonl": {"schema": {"type": "string"}}},
            },
            **errors(401, 404),
        },
    },
    ("/v1/batches", "get"): {
        "operationId": "listBatches",
        "tags": ["Batches"],
        "summary": "List the org's batches, newest first",
        "parameters": [LIMIT, AFTER],
        "responses": {"200": json_body(ref("BatchList")), **errors(400, 401)},
    },
    ("/v1/batches", "post"): {
        "operationId": "createBatch",
        "tags": ["Batches"],
        "summary": "Create a batch from an uploaded file",
        "description": "Every line is admitted as the completion endpoints admit a request; "
        "invalid lines go to the error file. The batch is `in_progress` at once, or `failed` "
        "when no line is valid.",
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": ref("CreateBatchRequest"),
                    "examples": examples(
                        chat={
                            "input_file_id": "file-abc123",
                            "endpoint": "/v1/chat/completions",
                            "completion_window": "24h",
                            "metadata": {"project": "reviews"},
                        }
                    ),
                }
            },
        },
        "responses": {"200": json_body(ref("Batch")), **errors(400, 401, 404)},
    },
    ("/v1/batches/{batch_id}", "get"): {
        "operationId": "retrieveBatch",
        "tags": ["Batches"],
        "summary": "Retrieve a batch",
        "responses": {"200": json_body(ref("Batch")), **errors(401, 404)},
    },
    ("/v1/batches/{batch_id}/cancel", "post"): {
        "operationId": "cancelBatch",
        "tags": ["Batches"],
        "summary": "Cancel a batch",
        "responses": {"200": json_body(ref("Batch")), **errors(401, 404)},
    },
    ("/v1/events", "get"): {
        "operationId": "streamEvents",
        "tags": ["Events"],
        "summary": "The org's events as a resumable Server-Sent Events stream",
        "description": "Every event after `Last-Event-ID` (or `after`), in order, then live ones, "
        "until the client disconnects; without either, only new events. A `: keepalive` comment "
        "every 15 s.",
        "parameters": [
            query("after", {"type": "string"}, "Resume after this event id."),
            query("types", {"type": "string"}, "Comma-separated event types to keep."),
            {
                "name": "Last-Event-ID",
                "in": "header",
                "required": False,
                "schema": {"type": "string"},
                "description": "Resume after this event id (wins over `after`).",
            },
        ],
        "responses": {
            "200": {
                "description": "The stream (it does not end by itself).",
                "content": {"text/event-stream": {"schema": ref("EventStreamEvent")}},
            },
            **errors(400, 401, 405),
        },
    },
    ("/v1/webhook_endpoints", "get"): {
        "operationId": "listWebhookEndpoints",
        "tags": ["Webhooks"],
        "summary": "List the org's webhook endpoints, oldest first",
        "responses": {"200": json_body(ref("WebhookEndpointList")), **errors(401)},
    },
    ("/v1/webhook_endpoints", "post"): {
        "operationId": "createWebhookEndpoint",
        "tags": ["Webhooks"],
        "summary": "Register a webhook endpoint (its secret is shown once)",
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": ref("CreateWebhookEndpointRequest"),
                    "examples": examples(
                        jobs={
                            "url": "https://example.com/hearth/webhooks",
                            "event_types": ["job.completed", "job.failed"],
                            "description": "results",
                        }
                    ),
                }
            },
        },
        "responses": {
            "201": json_body(ref("WebhookEndpointWithSecret"), "Created."),
            **errors(400, 401),
        },
    },
    ("/v1/webhook_endpoints/{endpoint_id}", "get"): {
        "operationId": "retrieveWebhookEndpoint",
        "tags": ["Webhooks"],
        "summary": "Retrieve a webhook endpoint",
        "responses": {"200": json_body(ref("WebhookEndpoint")), **errors(401, 404)},
    },
    ("/v1/webhook_endpoints/{endpoint_id}", "delete"): {
        "operationId": "deleteWebhookEndpoint",
        "tags": ["Webhooks"],
        "summary": "Delete a webhook endpoint and its delivery log",
        "responses": {"200": json_body(ref("DeletedWebhookEndpoint")), **errors(401, 404)},
    },
    ("/v1/webhook_endpoints/{endpoint_id}/rotate_secret", "post"): {
        "operationId": "rotateWebhookSecret",
        "tags": ["Webhooks"],
        "summary": "Replace the endpoint's signing secret (shown once)",
        "responses": {"200": json_body(ref("WebhookEndpointWithSecret")), **errors(401, 404)},
    },
    ("/v1/webhook_endpoints/{endpoint_id}/deliveries", "get"): {
        "operationId": "listWebhookDeliveries",
        "tags": ["Webhooks"],
        "summary": "Every delivery attempt to the endpoint, newest first",
        "parameters": [LIMIT],
        "responses": {"200": json_body(ref("WebhookDeliveryList")), **errors(400, 401, 404)},
    },
    ("/v1/usage", "get"): {
        "operationId": "usageReport",
        "tags": ["Billing"],
        "summary": "The org's usage and costs in a period, grouped by day, model or key",
        "parameters": [
            query("start", {"type": "string"}, "ISO 8601 date or date-time, UTC (inclusive)."),
            query("end", {"type": "string"}, "ISO 8601 date or date-time, UTC (exclusive)."),
            query("group_by", {"type": "string", "enum": ["day", "model", "key"]}, "Grouping."),
            query("format", {"type": "string", "enum": ["json", "csv"]}, "Or Accept: text/csv."),
        ],
        "responses": {
            "200": {
                "description": "The report, as JSON or CSV.",
                "content": {
                    "application/json": {"schema": ref("UsageReport")},
                    "text/csv": {"schema": {"type": "string"}},
                },
            },
            **errors(400, 401),
        },
    },
    ("/v1/invoices", "get"): {
        "operationId": "listInvoices",
        "tags": ["Billing"],
        "summary": "The org's monthly invoices, newest first",
        "responses": {"200": json_body(ref("InvoiceList")), **errors(401)},
    },
    ("/v1/invoices/{invoice_id}", "get"): {
        "operationId": "retrieveInvoice",
        "tags": ["Billing"],
        "summary": "Retrieve an invoice",
        "responses": {"200": json_body(ref("Invoice")), **errors(401, 404)},
    },
    ("/v1/budget", "get"): {
        "operationId": "retrieveBudget",
        "tags": ["Billing"],
        "summary": "The org's monthly budget and use, and each key's limits",
        "responses": {"200": json_body(ref("Budget")), **errors(401)},
    },
    ("/v1/budget", "post"): {
        "operationId": "updateBudget",
        "tags": ["Billing"],
        "summary": "Set or lift the org's monthly budget",
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": ref("UpdateBudgetRequest"),
                    "examples": examples(
                        set={"monthly_budget_usd": "250.00"}, lift={"monthly_budget_usd": None}
                    ),
                }
            },
        },
        "responses": {"200": json_body(ref("Budget")), **errors(400, 401)},
    },
    ("/v1/api_keys/{prefix}/limits", "post"): {
        "operationId": "updateApiKeyLimits",
        "tags": ["Billing"],
        "summary": "Set or lift a key's monthly budget and rate limits",
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": ref("UpdateApiKeyLimitsRequest"),
                    "examples": examples(
                        limits={"requests_per_minute": 600, "tokens_per_minute": 200000}
                    ),
                }
            },
        },
        "responses": {"200": json_body(ref("ApiKeyLimits")), **errors(400, 401, 404)},
    },
}

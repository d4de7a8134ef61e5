"""The job object as the API, the event log and the console show it."""

from __future__ import annotations

from typing import Any

from controlplane.api.responses import (
    completion_response,
    epoch_seconds,
    parses_tool_calls,
    usage_object,
)


def job_object(job) -> dict[str, Any]:
    """`{"id": "job_…", "object": "job", "status", …}`; a completed job carries the full
    completion `response` (what the sync request would have answered), `usage` and `cost`."""
    result = job.result or {}
    created = epoch_seconds(job.created)
    response = None
    if job.status == job.COMPLETED and result:
        response = completion_response(
            job.endpoint,
            job.request_id,
            job.model,
            created,
            result,
            tool_calls=parses_tool_calls(job.request or {}),
        )
    return {
        "id": job.id,
        "object": "job",
        "status": job.status,
        "model": job.model,
        "mode": job.mode,
        "endpoint": ENDPOINT_PATHS[job.endpoint],
        "request_id": job.request_id,
        "created": created,
        "started_at": epoch_seconds(job.started_at),
        "finished_at": epoch_seconds(job.finished_at),
        "node": job.node or None,
        "prefill_node": job.prefill_node or None,
        "attempts": job.attempts,
        "usage": usage_object(result["usage"]) if result.get("usage") else None,
        "cost": result.get("cost"),
        "response": response,
        "deadline_at": epoch_seconds(job.deadline_at),
        "cancel_requested_at": epoch_seconds(job.cancel_requested_at),
        "error": {"message": job.error, "code": _ERROR_CODES.get(job.status, "generation_failed")}
        if job.error
        else None,
    }


_ERROR_CODES = {"expired": "deadline_exceeded"}
# The URL a job's request came to (`Job.endpoint` holds the endpoint's name, "chat.completions").
ENDPOINT_PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions"}

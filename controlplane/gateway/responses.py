"""OpenAI's response shapes for completions, built from what a node reports.

The sync path, the stream and a finished job all build their bodies here, so a job's `response`
is exactly what the same request would have answered synchronously.
"""

from __future__ import annotations

from typing import Any

# The engine's reasons beyond OpenAI's `stop` and `length`: a request cut short by its deadline
# or an abort stopped early without choosing to, which OpenAI's enum calls `length` too.
_FINISH_REASONS = {"stop": "stop", "length": "length", "deadline": "length", "abort": "length"}


def epoch_seconds(moment) -> int | None:
    """A datetime as the API shows it, Unix seconds; None stays None."""
    return int(moment.timestamp()) if moment else None


def finish_reason(engine_reason: str | None) -> str | None:
    if engine_reason is None:
        return None
    return _FINISH_REASONS.get(engine_reason, "stop")


def usage_object(usage: dict[str, int]) -> dict[str, Any]:
    """OpenAI's CompletionUsage, `prompt_tokens_details.cached_tokens` always present."""
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def response_id(endpoint: str, request_id: str) -> str:
    prefix = "chatcmpl" if endpoint == "chat.completions" else "cmpl"
    return f"{prefix}-{request_id.removeprefix('req_')}"


def completion_response(
    endpoint: str,
    request_id: str,
    model: str,
    created: int,
    text: str,
    engine_finish_reason: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    """A `chat.completion` or `text_completion` object."""
    reason = finish_reason(engine_finish_reason)
    if endpoint == "chat.completions":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": reason,
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    return {
        "id": response_id(endpoint, request_id),
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_object(usage),
    }


def stream_chunk(
    endpoint: str,
    request_id: str,
    model: str,
    created: int,
    text: str | None = None,
    engine_finish_reason: str | None = None,
    first: bool = False,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One SSE chunk: a text delta, the finishing chunk, or (with `usage`) the usage chunk that
    `stream_options.include_usage` asks for, whose `choices` is empty."""
    if endpoint == "chat.completions":
        kind = "chat.completion.chunk"
        if usage is not None:
            choices = []
        else:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choices = [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish_reason(engine_finish_reason),
                }
            ]
    else:
        kind = "text_completion"
        choices = (
            []
            if usage is not None
            else [
                {
                    "index": 0,
                    "text": text or "",
                    "logprobs": None,
                    "finish_reason": finish_reason(engine_finish_reason),
                }
            ]
        )
    return {
        "id": response_id(endpoint, request_id),
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_object(usage) if usage is not None else None,
    }

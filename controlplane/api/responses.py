"""OpenAI's response shapes for completions, built from what a node reports.

The sync path, the stream and a finished job all build their bodies here, so a job's `response`
is exactly what the same request would have answered synchronously.
"""

from __future__ import annotations

from typing import Any

from inference.structured.tool_calls import ToolCall, parse_tool_calls

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


def parses_tool_calls(body: dict[str, Any]) -> bool:
    """Whether a request's output is read for tool calls: it offers tools, and does not say
    `tool_choice: "none"`."""
    return bool(body.get("tools")) and body.get("tool_choice") != "none"


def tool_call_id(request_id: str, index: int, choice: int = 0) -> str:
    """The id of a request's index-th call (in its `choice`-th choice): the same in its
    response, its stream and its job."""
    base = f"call_{request_id.removeprefix('req_')}"
    return f"{base}_{index}" if choice == 0 else f"{base}_c{choice}_{index}"


def openai_tool_calls(request_id: str, calls: list[ToolCall], choice: int = 0) -> list[dict]:
    return [call.as_openai(tool_call_id(request_id, i, choice)) for i, call in enumerate(calls)]


def logprobs_object(endpoint: str, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A choice's `logprobs`: chat's `{content, refusal}`, or the legacy completions shape
    (`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob}, `text_offset`)."""
    if entries is None:
        return None
    if endpoint == "chat.completions":
        return {"content": entries, "refusal": None}
    offsets, position = [], 0
    for entry in entries:
        offsets.append(position)
        position += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def response_id(endpoint: str, request_id: str) -> str:
    prefix = "chatcmpl" if endpoint == "chat.completions" else "cmpl"
    return f"{prefix}-{request_id.removeprefix('req_')}"


def node_choices(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each choice's `text`, `finish_reason` and `logprobs` in a node's result (its `done`
    message, or a job's `result`): `choices` when the request asked for n > 1, else the result's
    own, which are the first choice's."""
    return result.get("choices") or [result]


def completion_response(
    endpoint: str,
    request_id: str,
    model: str,
    created: int,
    result: dict[str, Any],
    tool_calls: bool = False,
) -> dict[str, Any]:
    """A `chat.completion` or `text_completion` object from a node's `result` (node_choices,
    and its `usage`). With `tool_calls` (parses_tool_calls), each choice's text is read for
    calls: found ones become its message's `tool_calls`."""
    body = {
        "id": response_id(endpoint, request_id),
        "object": "chat.completion" if endpoint == "chat.completions" else "text_completion",
        "created": created,
        "model": model,
        "choices": [
            choice_object(endpoint, request_id, index, choice, tool_calls)
            for index, choice in enumerate(node_choices(result))
        ],
        "usage": usage_object(result["usage"]),
    }
    return with_fingerprint(body, result.get("system_fingerprint"))


def with_fingerprint(body: dict[str, Any], fingerprint: str | None) -> dict[str, Any]:
    """`body` with the node engine's `system_fingerprint` (left out for a result recorded
    before nodes sent one)."""
    if fingerprint:
        body["system_fingerprint"] = fingerprint
    return body


def choice_object(
    endpoint: str, request_id: str, index: int, choice: dict[str, Any], tool_calls: bool
) -> dict[str, Any]:
    """One choice of a response, from what the node reported for it."""
    text = choice["text"]
    reason = finish_reason(choice["finish_reason"])
    logprobs = logprobs_object(endpoint, choice.get("logprobs"))
    if endpoint != "chat.completions":
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if tool_calls:
        content, calls = parse_tool_calls(text)
        if calls:
            message["content"] = content
            message["tool_calls"] = openai_tool_calls(request_id, calls, index)
            reason = "tool_calls"
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def stream_chunk(
    endpoint: str,
    request_id: str,
    model: str,
    created: int,
    text: str | None = None,
    engine_finish_reason: str | None = None,
    first: bool = False,
    usage: dict[str, int] | None = None,
    tool_call: dict[str, Any] | None = None,
    reason: str | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    index: int = 0,
    system_fingerprint: str | None = None,
) -> dict[str, Any]:
    """One SSE chunk: a text delta, a `tool_calls` delta (`tool_call`: one entry of it), the
    finishing chunk (`reason` overrides the engine's), or (with `usage`) the usage chunk that
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
            if tool_call is not None:
                delta["tool_calls"] = [tool_call]
            choices = [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs_object(endpoint, logprobs),
                    "finish_reason": reason or finish_reason(engine_finish_reason),
                }
            ]
    else:
        kind = "text_completion"
        choices = (
            []
            if usage is not None
            else [
                {
                    "index": index,
                    "text": text or "",
                    "logprobs": logprobs_object(endpoint, logprobs),
                    "finish_reason": finish_reason(engine_finish_reason),
                }
            ]
        )
    body = {
        "id": response_id(endpoint, request_id),
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_object(usage) if usage is not None else None,
    }
    return with_fingerprint(body, system_fingerprint)

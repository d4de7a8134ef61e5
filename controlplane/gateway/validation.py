"""Validation of completion requests: OpenAI's fields, types and ranges, checked by hand.

DRF's serializers coerce ("1" becomes 1, "true" becomes True); OpenAI answers a wrong type with a
400 naming the field, and so does Hearth. Every check raises ApiError(400) with `param` set.
Fields that a later issue brings (tools, response_format, logprobs, n > 1) are refused with a
clear message rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controlplane.gateway.errors import ApiError

_ROLES = {"system", "developer", "user", "assistant"}
# Accepted and without effect on generation (OpenAI's bookkeeping fields).
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
_NOT_YET = {
    "tools": "tool calling",
    "tool_choice": "tool calling",
    "functions": "function calling",
    "function_call": "function calling",
    "response_format": "structured outputs",
    "logit_bias": "logit_bias",
    "top_logprobs": "top_logprobs",
    "prediction": "predicted outputs",
    "audio": "audio output",
    "modalities": "other modalities",
    "best_of": "best_of",
    "suffix": "suffix",
}
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "queue",
    "reject_if_busy",
    "deadline_s",
}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
TEXT_FIELDS = _COMMON | {"prompt", "echo"}


def _bad(param: str, message: str, code: str = "invalid_type") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_unset(name: str, value: Any) -> bool:
    """Whether a not-yet-supported field holds its no-op value (SDKs send some of them)."""
    return value in (None, False, [], {}) or (name == "best_of" and value == 1)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class CompletionRequest:
    """A validated request: what to tokenize, how to sample, and how to answer."""

    model: str
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    queue: bool = False
    reject_if_busy: bool = False
    deadline_s: int | None = None


def _number(body: dict, name: str, low: float, high: float, sampling: dict, low_open=False):
    if name not in body or body[name] is None:
        return
    value = body[name]
    if not _is_number(value):
        raise _bad(name, f"'{name}' must be a number, got {type(value).__name__}.")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise _bad(
            name, f"'{name}' must be in {bracket}{low}, {high}], got {value}.", "invalid_value"
        )
    sampling[name] = float(value)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, f"'{name}' must be a boolean, got {type(value).__name__}.")
    return value


def _content_text(content: Any, index: int) -> str:
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(param, "Only text content parts are supported.", "invalid_value")
            if not isinstance(part.get("text"), str):
                raise _bad(f"{param}.text", "A text part needs a string 'text'.")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(param, "'content' must be a string or a list of text parts.")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty array of message objects.")
    rendered = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{index}]", "Each message must be an object.")
        role = message.get("role")
        if role == "tool":
            raise _bad(
                f"messages[{index}].role", "Tool messages are not supported yet.", "unsupported"
            )
        if role not in _ROLES:
            raise _bad(
                f"messages[{index}].role",
                f"'role' must be one of {sorted(_ROLES)}, got {role!r}.",
                "invalid_value",
            )
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        # The chat templates know "system"; OpenAI's "developer" is its newer name.
        rendered.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _content_text(content, index),
            }
        )
    return rendered


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "'prompt' must not be empty.", "invalid_value")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("prompt", "Only one prompt per request is supported yet.", "unsupported")
    raise _bad("prompt", "'prompt' must be a string or an array of token ids.")


def _stop(body: dict, sampling: dict) -> None:
    stop = body.get("stop")
    if stop is None:
        return
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "'stop' must be a non-empty string or an array of them.")
    if len(stops) > 4:
        raise _bad("stop", "'stop' accepts at most 4 sequences.", "invalid_value")
    sampling["stop"] = stops


def _max_tokens(body: dict, names: tuple[str, ...]) -> int | None:
    value = None
    for name in names:
        if body.get(name) is None:
            continue
        value = body[name]
        if not _is_int(value):
            raise _bad(name, f"'{name}' must be an integer, got {type(value).__name__}.")
        if value < 1:
            raise _bad(name, f"'{name}' must be at least 1, got {value}.", "invalid_value")
    return value


# The longest a job may wait and run: a week.
MAX_DEADLINE_S = 7 * 24 * 3600


def _deadline(body: dict) -> int | None:
    """Hearth's `deadline_s`: seconds from submission after which the job is expired."""
    value = body.get("deadline_s")
    if value is None:
        return None
    if not _is_int(value):
        raise _bad("deadline_s", f"'deadline_s' must be an integer, got {type(value).__name__}.")
    if not 1 <= value <= MAX_DEADLINE_S:
        raise _bad(
            "deadline_s",
            f"'deadline_s' must be between 1 and {MAX_DEADLINE_S} seconds, got {value}.",
            "invalid_value",
        )
    return value


def validate_completion_request(body: Any, endpoint: str) -> CompletionRequest:
    """Check a chat (`chat.completions`) or text (`completions`) request body."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    allowed = CHAT_FIELDS if endpoint == "chat.completions" else TEXT_FIELDS
    for name, value in body.items():
        if name in _NOT_YET and not _is_unset(name, value):
            raise _bad(name, f"'{name}' ({_NOT_YET[name]}) is not supported yet.", "unsupported")
        if name not in allowed and name not in _IGNORED and name not in _NOT_YET:
            raise _bad(name, f"Unrecognized request argument supplied: {name}", "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "'model' must be a non-empty string.")
    sampling: dict[str, Any] = {}
    _number(body, "temperature", 0.0, 2.0, sampling)
    _number(body, "top_p", 0.0, 1.0, sampling, low_open=True)
    _number(body, "min_p", 0.0, 1.0, sampling)
    _number(body, "presence_penalty", -2.0, 2.0, sampling)
    _number(body, "frequency_penalty", -2.0, 2.0, sampling)
    _number(body, "repetition_penalty", 0.0, 10.0, sampling, low_open=True)
    for name in ("top_k", "seed"):
        if body.get(name) is not None:
            if not _is_int(body[name]):
                raise _bad(name, f"'{name}' must be an integer.")
            if name == "top_k" and body[name] < 0:
                raise _bad(name, "'top_k' must be >= 0.", "invalid_value")
            sampling[name] = body[name]
    _stop(body, sampling)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n < 1):
        raise _bad("n", "'n' must be a positive integer.")
    if n not in (None, 1):
        raise _bad("n", "Only n=1 is supported yet.", "unsupported")
    if _flag(body, "logprobs"):
        raise _bad("logprobs", "'logprobs' is not supported yet.", "unsupported")
    if endpoint == "completions" and _flag(body, "echo"):
        raise _bad("echo", "'echo' is not supported yet.", "unsupported")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "'stream_options' must be an object.")
    include_usage = False
    if options:
        if not stream:
            raise _bad(
                "stream_options", "'stream_options' requires 'stream': true.", "invalid_value"
            )
        include_usage = _flag(options, "include_usage")
    request = CompletionRequest(
        model=model,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        queue=_flag(body, "queue"),
        reject_if_busy=_flag(body, "reject_if_busy"),
        deadline_s=_deadline(body),
    )
    if request.queue and stream:
        raise _bad(
            "stream", "A queued request cannot stream: its result is on the job.", "invalid_value"
        )
    if endpoint == "chat.completions":
        request.messages = _messages(body)
        request.max_tokens = _max_tokens(body, ("max_tokens", "max_completion_tokens"))
    else:
        request.prompt = _prompt(body)
        request.max_tokens = _max_tokens(body, ("max_tokens",))
    return request

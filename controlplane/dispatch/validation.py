"""Validation of completion requests: OpenAI's fields, types and ranges, checked by hand.

DRF's serializers coerce ("1" becomes 1, "true" becomes True); OpenAI answers a wrong type with a
400 naming the field, and so does Hearth. Every check raises ApiError(400) with `param` set.
Fields not built yet are refused with a clear message rather than silently ignored. The fields
that shape the output (response_format, tools) are checked in structured_fields.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controlplane.api.errors import ApiError
from controlplane.dispatch import structured_fields
from inference.protocol.messages import MAX_N

_ROLES = {"system", "developer", "user", "assistant", "tool"}
# Accepted and without effect on generation (OpenAI's bookkeeping fields).
_IGNORED = {"user", "metadata", "store", "service_tier"}
_NOT_YET = {
    "functions": "function calling (use 'tools')",
    "function_call": "function calling (use 'tool_choice')",
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
    "logit_bias",
}
CHAT_FIELDS = _COMMON | {
    "messages",
    "max_completion_tokens",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "top_logprobs",
}
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
    tools: list[dict] | None = None
    tool_choice: str = "none"  # 'none', 'auto', 'required' or a function's name

    @property
    def n(self) -> int:
        """How many completions of the prompt it asks for."""
        return self.sampling.get("n", 1)


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
        turn = {
            "role": "system" if role == "developer" else role,
            "content": _content_text(content, index),
        }
        if role == "assistant" and message.get("tool_calls") is not None:
            turn["tool_calls"] = structured_fields.assistant_tool_calls(message, index)
        if role == "tool":
            turn["tool_call_id"] = message.get("tool_call_id")
        rendered.append(turn)
    structured_fields.check_tool_messages(rendered)
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


def _logit_bias(body: dict, sampling: dict) -> None:
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise _bad("logit_bias", "'logit_bias' must map token ids to numbers.")
    for token, value in bias.items():
        if not str(token).isdigit() or not _is_number(value) or not -100 <= value <= 100:
            raise _bad(
                "logit_bias",
                f"'logit_bias' maps token ids to numbers in [-100, 100]; got {token!r}: {value!r}.",
                "invalid_value",
            )
    if bias:
        sampling["logit_bias"] = {str(int(token)): float(v) for token, v in bias.items()}


def _logprobs(body: dict, endpoint: str, sampling: dict) -> None:
    """Chat: `logprobs` (a boolean) and `top_logprobs` (0-20, needs logprobs). Completions: the
    legacy `logprobs`, how many alternatives (0-5) to return with each token's log-probability."""
    if endpoint == "completions":
        value = body.get("logprobs")
        if value is None:
            return
        if not _is_int(value) or not 0 <= value <= 5:
            raise _bad("logprobs", "'logprobs' must be an integer in [0, 5].", "invalid_value")
        sampling.update(logprobs=True, top_logprobs=value)
        return
    wanted = _flag(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= 20:
            raise _bad(
                "top_logprobs", "'top_logprobs' must be an integer in [0, 20].", "invalid_value"
            )
        if not wanted:
            raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs': true.", "invalid_value")
    if wanted:
        sampling.update(logprobs=True, top_logprobs=top or 0)


def _shape_output(body: dict, request: CompletionRequest) -> None:
    """Tools and response format: what the request may call, and the grammar of its output."""
    request.tools = structured_fields.tools(body)
    request.tool_choice = structured_fields.tool_choice(body, request.tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean.")
    spec = structured_fields.response_format(body)
    if request.tools:
        spec = (
            structured_fields.tool_call_spec(request.tools, request.tool_choice, parallel) or spec
        )
    if spec is not None:
        request.sampling["structured"] = spec


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
    _logit_bias(body, sampling)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n < 1):
        raise _bad("n", "'n' must be a positive integer.")
    if n is not None and n > MAX_N:
        raise _bad("n", f"'n' must be at most {MAX_N}, got {n}.", "invalid_value")
    if n and n > 1:
        sampling["n"] = n
    _logprobs(body, endpoint, sampling)
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
        _shape_output(body, request)
    else:
        request.prompt = _prompt(body)
        request.max_tokens = _max_tokens(body, ("max_tokens",))
    return request

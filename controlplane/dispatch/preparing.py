"""Preparing a completion request: validation, the model, tokenization with the model's own
chat template, and the context check. The completion views (through admission) and each line of a
batch go through this same step; it writes nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controlplane.api.errors import ApiError
from controlplane.api.responses import parses_tool_calls
from controlplane.catalog.models import ServedModel
from controlplane.dispatch.tokenization import prompt_token_ids, tokenizer_for
from controlplane.dispatch.validation import CompletionRequest, validate_completion_request


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

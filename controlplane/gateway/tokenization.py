"""Prompts to token ids with the engine's own tokenizer and chat template (inference.engine), so
the gateway's counts and the node's agree token for token."""

from __future__ import annotations

import threading
from functools import lru_cache

from controlplane.gateway.errors import ApiError
from inference.engine.tokenizer import Tokenizer
from inference.errors import ModelLoadError
from inference.models.loader import resolve_model_directory

_load_lock = threading.Lock()


@lru_cache(maxsize=32)
def _tokenizer(source: str) -> Tokenizer:
    return Tokenizer(resolve_model_directory(source))


def tokenizer_for(source: str) -> Tokenizer:
    """The tokenizer of a catalog model's weights, loaded once per process."""
    with _load_lock:  # a GGUF is converted on first use: once, not once per concurrent request
        try:
            return _tokenizer(source)
        except ModelLoadError as error:
            raise ApiError(503, f"The model's tokenizer is unavailable: {error}") from error


def prompt_token_ids(tokenizer: Tokenizer, messages: list[dict] | None, prompt) -> list[int]:
    """Chat messages rendered with the model's template, or a text prompt, or token ids as given."""
    if messages is not None:
        try:
            return tokenizer.apply_chat_template(messages)
        except ValueError as error:
            raise ApiError(400, str(error), param="messages", code="invalid_value") from error
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    vocab = tokenizer.vocab_size
    if any(t >= vocab for t in prompt):
        raise ApiError(
            400, f"Token ids must be below the vocabulary size {vocab}.", "prompt", "invalid_value"
        )
    return list(prompt)

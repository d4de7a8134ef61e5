"""Prompts to token ids with the engine's own tokenizer and chat template (inference.engine), so
the gateway's counts and the node's agree token for token."""

from __future__ import annotations

import logging
import threading
from functools import lru_cache

from django.db import DatabaseError

from controlplane.api.errors import ApiError
from controlplane.catalog.models import ServedModel
from inference.engine.tokenizer import Tokenizer
from inference.errors import ModelLoadError
from inference.models.loader import resolve_model_directory

logger = logging.getLogger(__name__)
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


def load_catalog_tokenizers() -> None:
    """Load the tokenizer of every enabled catalog model now (a gateway's start-up), so that the
    first request of each model does not pay for it: most of it is spent importing
    transformers' tokenizer code. Best effort: a model whose tokenizer cannot load, or a
    database not there yet, is left to the first request, which answers as it always did."""
    try:
        sources = list(ServedModel.objects.filter(enabled=True).values_list("source", flat=True))
    except DatabaseError as error:
        logger.warning("tokenizers not loaded at start-up: %s", error)
        return
    for source in sources:
        try:
            tokenizer_for(source)
        except ApiError as error:
            logger.warning("tokenizer of %s not loaded at start-up: %s", source, error.message)


def prompt_token_ids(
    tokenizer: Tokenizer, messages: list[dict] | None, prompt, tools: list[dict] | None = None
) -> list[int]:
    """Chat messages (with the `tools` offered) rendered with the model's template, or a text
    prompt, or token ids as given."""
    if messages is not None:
        try:
            return tokenizer.apply_chat_template(messages, tools)
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

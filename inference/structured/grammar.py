"""Compiled grammars and per-request matchers: the engine's side of constrained decoding.

One `GrammarCompiler` per engine, built on first use from the model's tokenizer (xgrammar reads
its vocabulary), caches compiled grammars by spec, so a schema shared by many requests compiles
once. Each constrained request holds a `Constraint`: its matcher, advanced by every token the
request samples. The sampler asks the batch's constraints for a token bitmask and applies it to
their rows only; unconstrained rows in the same batch are untouched.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch

from inference.errors import InvalidRequestError
from inference.structured.spec import grammar_for


class Constraint:
    """One request's grammar state."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar refuses it (it never should: the
        token was drawn under this grammar's mask)."""
        return self.matcher.accept_token(token_id)

    @property
    def finished(self) -> bool:
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles specs against one tokenizer's vocabulary and hands out matchers."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: set[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        # Compiled grammars are cached here, by spec (below); xgrammar's own cache would hold
        # them a second time.
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._cache: dict[str, Any] = {}
        self._lock = threading.Lock()

    def constraint(self, spec: dict[str, Any]) -> Constraint:
        """A fresh matcher for `spec`; InvalidRequestError when the spec cannot be compiled."""
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is None:
                grammar = grammar_for(spec)
                try:
                    compiled = self._compiler.compile_grammar(grammar)
                except (RuntimeError, ValueError) as error:
                    raise InvalidRequestError(
                        f"the grammar engine cannot compile this spec: {error}", "response_format"
                    ) from None
                if len(self._cache) >= 256:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = compiled
        return Constraint(self._xgr.GrammarMatcher(compiled))

    def bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Set to -inf, in place, every logit the bitmask forbids (`logits` [rows, vocab]).

        On the CPU the bits are unpacked with numpy and applied as one masked fill, faster than
        xgrammar's CPU routine (docs/performance.md). Elsewhere xgrammar's own kernel runs."""
        if logits.device.type != "cpu":
            self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
            return
        # Bit j of 32-bit word i allows token 32 i + j: little-endian bytes, little bit order.
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
        forbidden = torch.from_numpy(allowed[:, : logits.shape[-1]]) == 0
        logits.masked_fill_(forbidden, float("-inf"))

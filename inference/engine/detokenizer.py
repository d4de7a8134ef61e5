"""Incremental detokenization and stop strings.

Text is emitted only once it is final: a token that ends inside a multi-byte UTF-8 character
decodes to U+FFFD and is held until the character completes, and text that could be the start of
a stop string is held until it is known not to be one, so a stop string is never split across
deltas and never emitted.
"""

from __future__ import annotations

from inference.engine.tokenizer import Tokenizer

# Prompt tokens kept as decoding context, so the first output token gets its leading space right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of safe text deltas."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = stop
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add_token(self, token_id: int) -> None:
        """Decode one more token into `text`; sets `stopped` when a stop string appears."""
        self.tokens.append(token_id)
        prefix_text = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.tokens[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if self.stop:
            positions = [p for s in self.stop if (p := self.text.find(s, search_from)) >= 0]
            if positions:
                self.text = self.text[: min(positions)]
                self.stopped = True

    def take_delta(self, final: bool) -> str:
        """Text not emitted before that is now safe to emit (all of it when `final`)."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._stop_prefix_overlap()
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta

    def _stop_prefix_overlap(self) -> int:
        """Length of the longest suffix of `text` that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

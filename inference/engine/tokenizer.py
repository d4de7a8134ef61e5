"""The model's tokenizer and chat template, loaded from the same directory as its weights.

The gateway uses this class too, so prompt token counts and prefix hashes agree with the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from inference.structured.tool_prompt import prepare_messages


class Tokenizer:
    """Encode, decode and render chat messages for one model."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(directory))
        # The Rust tokenizer itself, used when `hf.decode` is exactly its decode (no clean-up of
        # spaces after it): the incremental detokenizer decodes twice per generated token, and
        # transformers' wrapper around the call cost more than the decoding (py-spy of a node).
        self._backend = getattr(self.hf, "_tokenizer", None)
        self.eos_token_ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            self.eos_token_ids.add(self.hf.eos_token_id)
        generation_config = directory / "generation_config.json"
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            self.eos_token_ids.update(
                eos if isinstance(eos, list) else [eos] if eos is not None else []
            )

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None and not self.hf.clean_up_tokenization_spaces:
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of `messages` rendered with the model's own chat template; `tools` and
        tool calls as the template renders them, or in the documented fallback
        (inference/structured/tool_prompt.py)."""
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        messages, tools = prepare_messages(self.hf, messages, tools)
        text = self.hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return self.hf.encode(text, add_special_tokens=False)

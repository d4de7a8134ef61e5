"""Offline API: generate completions for a list of prompts in one call."""

from __future__ import annotations

import itertools

from inference.engine.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.outputs import CompletionOutput
from inference.engine.sampling_params import SamplingParams


class LLM:
    """`LLM(model).generate(prompts, SamplingParams(...))`, batched by the engine's scheduler."""

    def __init__(self, model: str = EngineConfig.model, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        namespace: str = "",
    ) -> list[CompletionOutput]:
        """Complete every prompt (text, or token ids); results come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(token_lists, params, namespace)

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        namespace: str = "",
    ) -> list[CompletionOutput]:
        """Answer one conversation or several, rendered with the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        token_lists = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self._run(token_lists, params, namespace)

    def _run(
        self,
        token_lists: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None,
        namespace: str,
    ) -> list[CompletionOutput]:
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(token_lists)
        if len(params) != len(token_lists):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [f"offline-{next(self._ids)}" for _ in token_lists]
        prompt_of = dict(zip(ids, token_lists, strict=True))
        for request_id, tokens, p in zip(ids, token_lists, params, strict=True):
            self.engine.add_request(request_id, tokens, p, namespace=namespace)
        results: dict[str, CompletionOutput] = {}
        partial: dict[str, tuple[list[str], list[int], list]] = {i: ([], [], []) for i in ids}
        while len(results) < len(ids):
            for out in self.engine.step():
                texts, tokens, logprobs = partial[out.request_id]
                texts.append(out.text)
                tokens.extend(out.token_ids)
                logprobs.extend(out.logprobs)
                if out.finished:
                    results[out.request_id] = CompletionOutput(
                        request_id=out.request_id,
                        prompt_token_ids=prompt_of[out.request_id],
                        text="".join(texts),
                        token_ids=tokens,
                        finish_reason=out.finish_reason,
                        prompt_tokens=out.prompt_tokens,
                        cached_tokens=out.cached_tokens,
                        completion_tokens=out.completion_tokens,
                        logprobs=logprobs,
                        timings=out.timings,
                    )
        return [results[i] for i in ids]

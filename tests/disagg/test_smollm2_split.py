"""SmolLM2-135M-Instruct (the real weights, float32): prompts whose KV a prefill engine computed
and wrote over the Transfer Engine decode to the tokens unified mode gives.

In float32, not bfloat16: the CPU's bfloat16 matrix products round a row differently with the
number of rows beside it, so a prompt computed in other chunks (the prefill node's) can flip a
near-tie greedy choice, as batching alone does in unified mode (issue 30, deterministic
inference, is about that)."""

from __future__ import annotations

import pytest

from inference.disagg.layout import kv_layout_of
from inference.disagg.transfer import KVTransfer
from inference.engine import EngineConfig, LLMEngine, SamplingParams
from inference.engine.tokenizer import Tokenizer
from inference.models.loader import resolve_model_directory
from tests.disagg.split_engines import generate_split

pytestmark = pytest.mark.smollm2

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
DOCUMENT = (
    "Hearth serves language models to agents. Each node keeps a paged cache of keys and values, "
    "and a prefix cache lets a long conversation reuse what it computed on its last turn. "
)


def make_engine(**overrides) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="SmolLM2-135M-Instruct",
            dtype="float32",
            kv_cache_memory_bytes=64 << 20,
            **overrides,
        )
    )


def generate(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.token_ids)
    return tokens


def test_split_prefill_decodes_smollm2_to_the_unified_tokens():
    tokenizer = Tokenizer(resolve_model_directory("SmolLM2-135M-Instruct"))
    prompts = {
        "long": tokenizer.apply_chat_template(
            [{"role": "user", "content": DOCUMENT * 20 + "Summarise this in one line."}]
        ),
        "short": tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}]
        ),
    }
    assert len(prompts["long"]) > 700
    # One prompt at a time in both modes: the CPU's matrix products round a row differently with
    # the rows beside it, so prompts batched otherwise could differ in a near tie (issue 30).
    decode, prefill = make_engine(), make_engine(max_num_batched_tokens=256)  # chunked
    ours = KVTransfer(prefill.runner.kv_buffer, kv_layout_of(prefill, "smollm2"))
    theirs = KVTransfer(decode.runner.kv_buffer, kv_layout_of(decode, "smollm2"))
    for request_id, prompt in prompts.items():
        unified = generate(make_engine(), {request_id: prompt})[request_id]
        split = generate_split(decode, prefill, (ours, theirs), request_id, prompt, GREEDY)
        assert split == unified, request_id

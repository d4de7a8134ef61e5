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

pytestmark = pytest.mark.smollm2

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
DOCUMENT = (
    "Hearth serves language models to agents. Each node keeps a paged cache of keys and values, "
    "and a prefix cache lets a long conversation reuse what it computed on its last turn. "
)


def make_engine(**overrides) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model="SmolLM2-135M-Instruct", kv_cache_memory_bytes=64 << 20, **overrides)
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
        decode.add_request(request_id, prompt, GREEDY, remote_prefill=True)
        decode.step()
        [kv] = decode.take_kv_requests()
        assert kv.token_ids == prompt[:-1]
        prefill.add_request(request_id, kv.token_ids, prefill_only=True)
        while prefill.has_unfinished_requests():
            for output in prefill.step():
                assert output.finish_reason == "prefilled" and not output.token_ids
        blocks = prefill.prefilled_blocks(request_id)[kv.first_block :]
        last_tokens = len(kv.token_ids) - (kv.first_block + len(blocks) - 1) * 16
        ours.write_blocks(theirs.region, blocks, kv.block_ids, last_tokens)
        prefill.release_prefilled(request_id)
        assert decode.kv_arrived(request_id, kv.epoch)
        split: list[int] = []
        while decode.has_unfinished_requests():
            for output in decode.step():
                split.extend(output.token_ids)
        assert split == unified, request_id

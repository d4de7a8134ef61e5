"""Greedy output of the engine is token-identical to Hugging Face on tiny random models, whatever
the batching, chunking, preemption or prefix-cache state."""

from __future__ import annotations

import random

import pytest

from inference.engine import LLM, SamplingParams
from tests.inference.conftest import hf_greedy

MAX_NEW = 24


def make_prompts(vocab_size: int, count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 7, 16, 17, 33, 50, 64, 90][:count]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_model_dir)).vocab_size
    prompts = make_prompts(vocab, 9)
    return prompts, hf_greedy(tiny_model_dir, prompts, MAX_NEW)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="default"),
        pytest.param({"max_num_batched_tokens": 8}, id="chunked-prefill-8"),
        pytest.param({"block_size": 32, "max_num_batched_tokens": 40}, id="block32-chunked"),
        pytest.param({"num_kv_blocks": 10}, id="preemption"),
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
    ],
)
def test_batched_greedy_matches_hf(tiny_model_dir, reference, options):
    prompts, expected = reference
    llm = LLM(str(tiny_model_dir), dtype="float32", **options)
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    if "num_kv_blocks" in options:
        assert llm.engine.block_manager.num_blocks == 10
        # The case only shows recompute-after-preemption if preemption happened.
        assert llm.engine.scheduler.num_preemptions > 0


def test_one_at_a_time_matches_hf(tiny_model_dir, reference):
    prompts, expected = reference
    llm = LLM(str(tiny_model_dir), dtype="float32")
    for prompt, want in zip(prompts, expected, strict=True):
        [result] = llm.generate([prompt], GREEDY)
        assert result.token_ids == want


def test_cached_prefix_gives_same_tokens_and_reports_hits(tiny_model_dir, reference):
    prompts, _ = reference
    shared = prompts[-1][:64]  # four full blocks of 16
    first = shared + [5, 6, 7]
    second = shared + [9, 10]
    [want_first, want_second] = hf_greedy(tiny_model_dir, [first, second], MAX_NEW)
    llm = LLM(str(tiny_model_dir), dtype="float32")
    [a] = llm.generate([first], GREEDY)
    [b] = llm.generate([second], GREEDY)
    assert a.cached_tokens == 0
    assert b.cached_tokens == 64
    assert a.token_ids == want_first
    assert b.token_ids == want_second


def test_other_namespace_does_not_hit_the_cache(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    prompt = list(range(3, 60))
    [a] = llm.generate([prompt], GREEDY, namespace="org-a")
    [b] = llm.generate([prompt], GREEDY, namespace="org-b")
    [c] = llm.generate([prompt], GREEDY, namespace="org-a")
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (0, 0, 48)
    assert a.token_ids == b.token_ids == c.token_ids


def test_identical_prompt_recomputes_its_last_token(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    prompt = list(range(3, 35))  # exactly two blocks
    llm.generate([prompt], GREEDY)
    [again] = llm.generate([prompt], GREEDY)
    # The second block holds the last prompt token, which must be recomputed to get logits.
    assert again.cached_tokens == 16

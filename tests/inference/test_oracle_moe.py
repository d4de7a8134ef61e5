"""The sparse and latent-attention families (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 with and
without a query LoRA) give Hugging Face's greedy tokens on tiny random models, whatever the
batching, chunking, preemption or prefix-cache state; bf16 stays close to HF's bf16."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.engine import LLM, SamplingParams
from tests.inference.conftest import hf_greedy
from tests.inference.tiny_models import MOE_ARCHITECTURES, build_tiny_model

MAX_NEW = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=MOE_ARCHITECTURES)
def moe_model(request, tmp_path_factory):
    """(directory, prompts, HF's greedy continuations) for one family."""
    directory = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    rng = random.Random(7)
    vocab = AutoModelForCausalLM.from_pretrained(str(directory)).config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 16, 17, 40, 70)]
    return directory, prompts, hf_greedy(directory, prompts, MAX_NEW)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="batched"),
        pytest.param({"max_num_batched_tokens": 8}, id="chunked-prefill-8"),
        pytest.param({"num_kv_blocks": 9}, id="preemption"),
    ],
)
def test_batched_greedy_matches_hf(moe_model, options):
    directory, prompts, expected = moe_model
    llm = LLM(str(directory), dtype="float32", **options)
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0


def test_one_at_a_time_matches_hf(moe_model):
    directory, prompts, expected = moe_model
    llm = LLM(str(directory), dtype="float32")
    for prompt, want in zip(prompts, expected, strict=True):
        [result] = llm.generate([prompt], GREEDY)
        assert result.token_ids == want


def test_cached_prefix_gives_hf_tokens_and_counts_them(moe_model):
    directory, prompts, _ = moe_model
    shared = prompts[-1][:64]  # four full blocks of 16
    first, second = shared + [5, 6, 7], shared + [9, 10]
    want_first, want_second = hf_greedy(directory, [first, second], MAX_NEW)
    llm = LLM(str(directory), dtype="float32")
    [a] = llm.generate([first], GREEDY)
    [b] = llm.generate([second], GREEDY)
    assert (a.cached_tokens, b.cached_tokens) == (0, 64)
    assert (a.token_ids, b.token_ids) == (want_first, want_second)


def test_every_expert_token_is_counted(moe_model):
    directory, prompts, _ = moe_model
    llm = LLM(str(directory), dtype="float32")
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    model = llm.engine.runner.model
    moe = model.config.moe
    sparse_layers = sum(moe.is_sparse(i) for i in range(model.config.num_layers))
    computed = sum(len(p) for p in prompts[:2]) + 2 * 2  # prompts, then two more steps each
    assert int(model.expert_tokens().sum()) == computed * moe.top_k * sparse_layers


def test_bf16_stays_close_to_hf_bf16(moe_model):
    """bf16 rounds differently from HF's bf16 (fused projections, absorbed MLA decode, expert
    sums in float32), so the check is on each prompt's next-token distribution: the engine's
    top-1 is HF's top-1 or within 0.1 nats of it (bf16 often makes exact ties), at least 5 of
    the 6 agree exactly, and every top-5 log-probability is within 0.1 of HF's."""
    directory, prompts, _ = moe_model
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.bfloat16)
    llm = LLM(str(directory), dtype="bfloat16")
    params = SamplingParams(
        temperature=0.0, max_tokens=1, logprobs=True, top_logprobs=5, ignore_eos=True
    )
    agreed = 0
    for prompt in prompts:
        with torch.inference_mode():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        [result] = llm.generate([prompt], params)
        top = result.logprobs[0]
        agreed += top.token_id == int(want.argmax())
        assert float(want[top.token_id]) >= float(want.max()) - 0.1
        for token_id, logprob in top.top_logprobs:
            assert abs(logprob - float(want[token_id])) < 0.1
    assert agreed >= len(prompts) - 1

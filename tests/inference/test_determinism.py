"""Deterministic mode: a greedy or seeded request gets bitwise the same tokens and logprobs
whatever shares its steps, however its prefill is chunked, whether its prompt came from the
prefix cache, after preemption, and at any thread count. Tiny random models of every family the
engine serves in deterministic mode (MLA is refused), in bfloat16 and float32; the default model
in the dtype this CPU serves it in (`dtype="auto"`: bfloat16 with native bf16, else float32)."""

from __future__ import annotations

import random

import pytest

from inference.engine import LLM, EngineConfig, SamplingParams
from inference.engine.cpu_dtype import preferred_dtype
from tests.inference.tiny_models import build_tiny_model

MAX_NEW = 12
# Prompt lengths cross a key split (256), the chunk budgets below and block edges.
LENGTHS = [1, 7, 16, 33, 90, 255, 256, 257, 300, 520, 700]


def _params(seeded: bool) -> list[SamplingParams]:
    """Greedy with logprobs, and seeded sampling at temperature 0.9 with logprobs."""
    return [
        SamplingParams(
            temperature=0.9 if seeded else 0.0,
            seed=1000 + index if seeded else None,
            max_tokens=MAX_NEW,
            ignore_eos=True,
            logprobs=True,
            top_logprobs=3,
        )
        for index in range(len(LENGTHS))
    ]


def _prompts(vocab_size: int, lengths: list[int], seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(max(lengths))]
    # Half the prompts share a prefix (a prefix-cache hit in the warm runs), half are their own.
    return [
        shared[:n] if index % 2 else [rng.randrange(3, vocab_size) for _ in range(n)]
        for index, n in enumerate(lengths)
    ]


def _answers(results) -> list[tuple]:
    """Each result's tokens and logprobs (value and top alternatives), exactly."""
    return [
        (
            tuple(r.token_ids),
            tuple((lp.token_id, lp.logprob, tuple(lp.top_logprobs)) for lp in r.logprobs),
        )
        for r in results
    ]


def _alone(llm, prompts, params):
    return [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]


def _scenarios(
    model_dir: str,
    dtype: str,
    prompts,
    params,
    kv_blocks: int | None = 48,
    deterministic: bool = True,
) -> dict:
    """Every way the same requests are run: name -> answers, in prompt order (`kv_blocks`: a
    cache too small for all of them at once, so that some are preempted and recomputed; None:
    no preemption run)."""
    runs = {}
    alone = LLM(model_dir, dtype=dtype, deterministic=deterministic, enable_prefix_caching=False)
    runs["alone"] = _answers(_alone(alone, prompts, params))
    for budget in (64, 512, 2048):
        llm = LLM(
            model_dir, dtype=dtype, deterministic=deterministic, max_num_batched_tokens=budget
        )
        order = list(range(len(prompts)))
        random.Random(budget).shuffle(order)
        shuffled = llm.generate([prompts[i] for i in order], [params[i] for i in order])
        by_prompt = dict(zip(order, _answers(shuffled), strict=True))
        runs[f"together, shuffled, budget {budget}"] = [by_prompt[i] for i in range(len(order))]
        if budget == 512:
            # The same engine again: every prompt's full blocks now come from the cache.
            warm = llm.generate(prompts, params)
            assert sum(r.cached_tokens for r in warm) > 0
            runs["warm cache, together"] = _answers(warm)
            runs["warm cache, alone"] = _answers(_alone(llm, prompts, params))
    if kv_blocks is not None:
        tight = LLM(model_dir, dtype=dtype, deterministic=deterministic, num_kv_blocks=kv_blocks)
        runs["preemption"] = _answers(tight.generate(prompts, params))
        assert tight.engine.scheduler.num_preemptions > 0
    one_thread = LLM(model_dir, dtype=dtype, deterministic=deterministic, cpu_threads=1)
    runs["one thread, together"] = _answers(one_thread.generate(prompts, params))
    return runs


def _assert_all_equal(runs: dict[str, list], prompts) -> None:
    baseline = runs["alone"]
    for name, answers in runs.items():
        for index, (got, want) in enumerate(zip(answers, baseline, strict=True)):
            assert got == want, f"{name}: prompt {index} ({len(prompts[index])} tokens) differs"


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mixtral", "qwen2-moe"])
def family_dir(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(f"det-{request.param}"), request.param)


# Greedy and seeded in the dtype this CPU serves by default, greedy in the other one.
_SERVED = preferred_dtype()
_OTHER = "float32" if _SERVED == "bfloat16" else "bfloat16"


@pytest.mark.parametrize(
    ("seeded", "dtype"),
    [(False, _SERVED), (True, _SERVED), (False, _OTHER)],
    ids=[f"greedy-{_SERVED}", f"seeded-{_SERVED}", f"greedy-{_OTHER}"],
)
def test_tiny_models_answer_bitwise_the_same_in_every_scenario(family_dir, seeded, dtype):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(family_dir)).vocab_size
    prompts = _prompts(vocab, LENGTHS)
    _assert_all_equal(_scenarios(str(family_dir), dtype, prompts, _params(seeded)), prompts)


def test_the_default_model_answers_bitwise_the_same_in_every_scenario():
    """SmolLM2 in the dtype this CPU serves it in: prompts up to 2,100 tokens (crossing 256 and
    1,024 rows in one step), half sharing a 900-token prefix, greedy with logprobs. (Preemption
    is covered on the tiny models: with these four prompts the scheduler never admits more than
    fits.)"""
    lengths = [5, 300, 1100, 2100]
    rng = random.Random(11)
    shared = [rng.randrange(100, 49000) for _ in range(900)]
    prompts = [
        shared + [rng.randrange(100, 49000) for _ in range(n - 900)]
        if n > 900
        else [rng.randrange(100, 49000) for _ in range(n)]
        for n in lengths
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True) for _ in prompts
    ]
    runs = _scenarios(EngineConfig.model, preferred_dtype(), prompts, params, kv_blocks=None)
    _assert_all_equal(runs, prompts)


def test_mla_models_are_refused_in_deterministic_mode(tmp_path):
    model_dir = build_tiny_model(tmp_path / "mla", "deepseek-v3")
    with pytest.raises(ValueError, match="MLA"):
        LLM(str(model_dir), dtype="bfloat16", deterministic=True)


def test_default_mode_may_drift_but_only_this_far(tiny_llama_dir):
    """Default mode promises nothing bitwise: the same greedy requests in the same scenarios
    may get other logprobs and, after a near tie, other tokens. Measured on this tiny model in
    bf16 (2026-12-07): up to 0.017 nats on the tokens both runs share, 1 to 2 of 11 answers
    diverging after their fourth token. Stated here with margin: at most 0.05 nats while the
    tokens agree, and at least 8 of 11 answers token-identical in every scenario."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_llama_dir)).vocab_size
    prompts = _prompts(vocab, LENGTHS)
    runs = _scenarios(str(tiny_llama_dir), "bfloat16", prompts, _params(False), deterministic=False)
    baseline = runs["alone"]
    for name, answers in runs.items():
        identical = 0
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(answers, baseline, strict=True):
            identical += tokens == want_tokens
            for index, (token, want) in enumerate(zip(tokens, want_tokens, strict=True)):
                if token != want:
                    break
                assert abs(logprobs[index][1] - want_logprobs[index][1]) <= 0.05, name
        assert identical >= 8, f"{name}: {identical} of {len(answers)} token-identical"

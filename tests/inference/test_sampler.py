"""Sampling: greedy, filters, seeds, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from inference.engine import SamplingParams
from inference.engine.sampler import apply_penalties, sample
from inference.engine.sequence import Sequence

VOCAB = 50


def seq(params: SamplingParams, tokens=(1, 2, 3), outputs=()) -> Sequence:
    s = Sequence("r", list(tokens), params)
    s.token_ids.extend(outputs)
    return s


def test_greedy_picks_the_argmax():
    logits = torch.randn(3, VOCAB)
    seqs = [seq(SamplingParams(temperature=0.0)) for _ in range(3)]
    tokens, _ = sample(logits, seqs)
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_even_at_high_temperature():
    logits = torch.randn(1, VOCAB)
    tokens, _ = sample(logits, [seq(SamplingParams(temperature=5.0, top_k=1))])
    assert tokens[0] == int(logits.argmax())


@pytest.mark.parametrize(
    "params,allowed",
    [
        (SamplingParams(temperature=1.0, top_k=3), {0, 1, 2}),
        # probs ~ [0.5, 0.25, 0.125, ...]: top_p=0.7 needs the first two tokens.
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),
        # min_p=0.3 keeps tokens with p >= 0.3 * 0.5.
        (SamplingParams(temperature=1.0, min_p=0.3), {0, 1}),
    ],
)
def test_filters_restrict_the_support(params, allowed):
    logits = torch.tensor([[math.log(0.5**i) for i in range(1, VOCAB + 1)]])
    generator_params = SamplingParams(**{**params.__dict__, "seed": 7})
    s = seq(generator_params)
    drawn = {sample(logits, [s])[0][0] for _ in range(300)}
    assert drawn == allowed


def test_a_seed_reproduces_whatever_shares_the_batch():
    logits = torch.randn(4, VOCAB)
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits[:1], [s])[0][0] for s in [seq(params)] for _ in range(20)]
    s = seq(params)
    others = [seq(SamplingParams(temperature=1.0)) for _ in range(3)]
    batched = [sample(logits, [s, *others])[0][0] for _ in range(20)]
    assert alone == batched
    assert len(set(alone)) > 1  # it really sampled


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.zeros(VOCAB)
    logits[1], logits[2], logits[9] = 2.0, -2.0, 2.0
    out = apply_penalties(logits, seq(SamplingParams(repetition_penalty=2.0), tokens=(1, 2)))
    assert (out[1].item(), out[2].item(), out[9].item()) == (1.0, -4.0, 2.0)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(VOCAB)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, seq(params, tokens=(4,), outputs=(7, 7, 7, 8)))
    assert out[4].item() == 0.0  # prompt token: no penalty
    assert out[7].item() == pytest.approx(-(0.5 + 3 * 0.25))
    assert out[8].item() == pytest.approx(-(0.5 + 0.25))


def test_logprobs_come_from_the_unmodified_distribution():
    logits = torch.randn(2, VOCAB)
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    tokens, logprobs = sample(logits, [seq(params), seq(SamplingParams(temperature=0.0))])
    expected = torch.log_softmax(logits[0], -1)
    assert logprobs[1] is None
    assert logprobs[0].token_id == tokens[0]
    assert logprobs[0].logprob == pytest.approx(expected[tokens[0]].item(), abs=1e-6)
    top = expected.topk(3)
    assert [t for t, _ in logprobs[0].top_logprobs] == top.indices.tolist()


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_k", -1),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("top_logprobs", 21),
        ("stop", [""]),
    ],
)
def test_invalid_values_are_rejected_naming_the_field(field, value):
    from inference.engine import InvalidRequestError

    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**{field: value})
    assert error.value.param == field
    assert field in str(error.value)

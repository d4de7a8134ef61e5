"""The MoE kernels: routing against Hugging Face's routers, the PyTorch reference against HF's
experts, and the Triton grouped GEMM (under the interpreter) against a float64 reference, on
fresh random inputs each run. Tolerances are stated per dtype."""

from __future__ import annotations

import os

# Must precede the import of the module holding the @triton.jit kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    MixtralConfig,
    Qwen2MoeConfig,
)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import (
    MixtralExperts,
    MixtralTopKRouter,
)
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

from kernels.fused_moe import fused_moe_torch, fused_moe_triton, moe_align_block_size
from kernels.moe_router import select_experts_torch as select_experts

# Maximum error relative to the output's largest magnitude, by dtype (worst of 900 random runs
# in brackets). float32 differs from float64 by rounding only (5e-7). bfloat16 keeps 8 bits of
# mantissa, and the inputs, the intermediate, each expert's output and the sum are rounded to
# it, a few steps of 2^-8 (1.2e-2 for Triton, whose stores the interpreter truncates rather than
# rounds to nearest as a GPU does; 9e-3 for the reference). float16 keeps 11 bits (1e-3 for the
# reference, which also rounds the activation's operands; 7e-4 for Triton).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype):
    """Every element within TOL[dtype] × max|expected|: outputs near zero carry the rounding
    error of the larger terms summed into them, so a per-element relative bound is wrong."""
    assert torch.isfinite(actual).all()  # a NaN would also fail below; this names the cause
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, atol=TOL[dtype] * scale, rtol=0)


def make_moe(tokens: int, hidden: int, inter: int, experts: int, dtype: torch.dtype):
    """Activations and expert weights scaled so every layer's outputs are of order 1."""
    x = torch.randn(tokens, hidden).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype)
    return x, w13, w2


def float64_reference(x, w13, w2, topk_weights, topk_ids, activation):
    return fused_moe_torch(
        x.double(), w13.double(), w2.double(), topk_weights.double(), topk_ids, activation
    )


def random_routing(tokens: int, experts: int, top_k: int):
    return select_experts(torch.randn(tokens, experts), top_k, renormalize=True)


# Routing


def test_select_experts_is_bit_identical_to_the_hugging_face_mixtral_router():
    config = MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
    router = MixtralTopKRouter(config)
    router.weight.data = torch.randn(8, 32)
    logits, hf_weights, hf_ids = router(torch.randn(37, 32))
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.long(), hf_ids)
    assert torch.equal(weights, hf_weights)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_select_experts_is_bit_identical_to_the_hugging_face_qwen2_moe_router(norm_topk_prob):
    config = Qwen2MoeConfig(
        hidden_size=32, num_experts=12, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob
    )
    router = Qwen2MoeTopKRouter(config)
    router.weight.data = torch.randn(12, 32)
    logits, hf_weights, hf_ids = router(torch.randn(37, 32))
    weights, ids = select_experts(logits, 4, renormalize=norm_topk_prob)
    assert torch.equal(ids.long(), hf_ids)
    assert torch.equal(weights, hf_weights)


def sorted_by_expert(weights: torch.Tensor, ids: torch.Tensor):
    """HF's DeepSeek routers use topk(sorted=False): compare each token's choices as a set."""
    ids, order = ids.long().sort(dim=-1)
    return weights.gather(1, order), ids


def test_select_experts_matches_the_hugging_face_deepseek_v3_router():
    config = DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    router = DeepseekV3TopkRouter(config)
    router.weight.data = torch.randn(16, 32)
    router.e_score_correction_bias.data = torch.randn(16) * 0.5
    logits, hf_weights, hf_ids = router(torch.randn(37, 32))
    weights, ids = select_experts(
        logits,
        4,
        renormalize=True,
        scoring="sigmoid",
        correction_bias=router.e_score_correction_bias,
        num_expert_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    hf_weights, hf_ids = sorted_by_expert(hf_weights, hf_ids)
    weights, ids = sorted_by_expert(weights, ids)
    assert torch.equal(ids, hf_ids)
    # Summed in a different order (HF's unsorted topk), so equal to float32 rounding only.
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-6)


def test_select_experts_matches_the_hugging_face_deepseek_v2_group_limited_router():
    config = DeepseekV2Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=16.0,
        topk_method="group_limited_greedy",
    )
    router = DeepseekV2TopkRouter(config)
    router.weight.data = torch.randn(16, 32)
    logits, hf_weights, hf_ids = router(torch.randn(37, 32))
    weights, ids = select_experts(
        logits, 3, renormalize=False, num_expert_group=4, topk_group=2, routed_scaling_factor=16.0
    )
    hf_weights, hf_ids = sorted_by_expert(hf_weights, hf_ids)
    weights, ids = sorted_by_expert(weights, ids)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights)


def test_softmax_routing_with_renormalise_sums_to_one_over_the_best_experts():
    logits = torch.randn(50, 8) * 3
    weights, ids = select_experts(logits, 3, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(50))  # float32 rounding of 3 terms
    best = logits.topk(3, dim=-1).indices
    assert torch.equal(ids.long(), best)
    assert (weights[:, :-1] >= weights[:, 1:]).all()


def test_softmax_routing_without_renormalise_keeps_the_softmax_probabilities():
    logits = torch.randn(50, 8).to(torch.bfloat16)
    weights, ids = select_experts(logits, 2, renormalize=False)
    probabilities = torch.softmax(logits.double(), dim=-1)
    # Softmax is taken in float32 from the bf16 logits: float32 rounding only.
    torch.testing.assert_close(
        weights.double(), probabilities.gather(1, ids.long()), atol=1e-6, rtol=1e-6
    )
    assert (weights.sum(-1) < 1).all()


def test_grouped_sigmoid_routing_chooses_from_kept_groups_with_unbiased_weights():
    tokens, experts, groups, keep, top_k = 40, 16, 4, 2, 3
    logits = torch.randn(tokens, experts)
    bias = torch.zeros(experts)
    bias[5] = 10.0  # expert 5 (group 1) wins every choice, whatever its own score
    weights, ids = select_experts(
        logits,
        top_k,
        renormalize=True,
        scoring="sigmoid",
        correction_bias=bias,
        num_expert_group=groups,
        topk_group=keep,
        routed_scaling_factor=1.0,
    )
    scores = logits.double().sigmoid()
    biased = (scores + bias.double()).view(tokens, groups, experts // groups)
    group_scores = biased.topk(2, dim=-1).values.sum(-1)
    kept = group_scores.topk(keep, dim=-1).indices
    for t in range(tokens):
        chosen_groups = set((ids[t].long() // (experts // groups)).tolist())
        assert chosen_groups <= set(kept[t].tolist())
        eligible = [e for e in range(experts) if e // (experts // groups) in kept[t].tolist()]
        best = sorted(eligible, key=lambda e: -(scores[t, e] + bias[e]).item())[:top_k]
        assert set(ids[t].tolist()) == set(best)
    assert (ids[:, 0] == 5).all()
    unbiased = scores.gather(1, ids.long())
    # Weights come from the unbiased scores, renormalised: float32 rounding only.
    torch.testing.assert_close(
        weights.double(), unbiased / unbiased.sum(-1, keepdim=True), atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_routed_scaling_factor_multiplies_the_weights(scoring):
    logits = torch.randn(20, 8)
    plain, plain_ids = select_experts(logits, 2, renormalize=True, scoring=scoring)
    scaled, scaled_ids = select_experts(
        logits, 2, renormalize=True, scoring=scoring, routed_scaling_factor=2.5
    )
    assert torch.equal(plain_ids, scaled_ids)
    torch.testing.assert_close(scaled, plain * 2.5)
    torch.testing.assert_close(scaled.sum(-1), torch.full((20,), 2.5))


# The PyTorch reference


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_reference_matches_hugging_face_mixtral_experts_in_float64(activation):
    tokens, hidden, inter, experts, top_k = 29, 40, 24, 6, 2
    config = MixtralConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        hidden_act=activation,
    )
    hf_experts = MixtralExperts(config).double()
    x, w13, w2 = make_moe(tokens, hidden, inter, experts, torch.float64)
    hf_experts.gate_up_proj.data, hf_experts.down_proj.data = w13, w2
    weights, ids = random_routing(tokens, experts, top_k)
    expected = hf_experts(x, ids.long(), weights.double())
    actual = fused_moe_torch(x, w13, w2, weights, ids, activation)
    torch.testing.assert_close(actual, expected, atol=1e-12, rtol=1e-12)  # float64 both


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_in_each_dtype_matches_float64(dtype):
    x, w13, w2 = make_moe(33, 72, 96, 8, dtype)
    weights, ids = random_routing(33, 8, 2)
    for activation in ("silu", "gelu"):
        expected = float64_reference(x, w13, w2, weights, ids, activation)
        out = torch.full_like(x, float("nan"))
        result = fused_moe_torch(x, w13, w2, weights, ids, activation, out=out)
        assert result is out and out.dtype == dtype
        assert_close_to_scale(out, expected, dtype)


# Block alignment


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 1), (33, 8, 3), (100, 6, 2)])
def test_moe_align_block_size_groups_every_pair_once_by_expert(block_m, tokens, experts, top_k):
    _, topk_ids = random_routing(tokens, experts, top_k)
    topk_ids[: tokens // 2, 0] = 0  # crowd expert 0 so some expert spans several blocks
    num_pairs = tokens * top_k
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids, block_m, experts)
    total = int(num_post_padded.item())
    counts = torch.bincount(topk_ids.flatten().long(), minlength=experts)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.numel() == num_pairs + experts * (block_m - 1)
    assert expert_ids.numel() == -(-sorted_ids.numel() // block_m)

    valid = sorted_ids[sorted_ids < num_pairs].long()
    assert torch.equal(valid.sort().values, torch.arange(num_pairs))  # each pair exactly once
    assert (sorted_ids[sorted_ids >= num_pairs] == num_pairs).all()  # padding is the sentinel
    assert (sorted_ids[total:] == num_pairs).all()

    expert_of_pair = topk_ids.flatten().long()
    blocks = sorted_ids[:total].view(-1, block_m).long()
    for block, expert in zip(blocks, expert_ids[: total // block_m].tolist(), strict=True):
        pairs = block[block < num_pairs]
        assert pairs.numel() > 0  # no block is all padding
        assert (expert_of_pair[pairs] == expert).all()  # one expert per block
        # Padding only trails an expert's group, so the kernel's rows stay dense.
        assert (block[: pairs.numel()] < num_pairs).all()
    used = expert_ids[: total // block_m].long()
    assert torch.equal(torch.bincount(used, minlength=experts), -(-counts // block_m))
    assert (expert_ids[total // block_m :] == -1).all()


# The Triton kernel, under the interpreter on the CPU


@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,top_k,activation,dtype",
    [
        (1, 64, 48, 4, 1, "silu", torch.float32),
        (7, 72, 96, 8, 2, "gelu", torch.float32),
        (33, 72, 48, 8, 3, "silu", torch.float32),
        (7, 64, 96, 4, 3, "silu", torch.bfloat16),
        (33, 72, 96, 8, 2, "gelu", torch.bfloat16),
        (33, 64, 48, 4, 3, "gelu", torch.float16),
        # Over 32 pairs per expert: the 64-row block configuration.
        (130, 72, 48, 4, 2, "silu", torch.float32),
        (97, 64, 96, 4, 3, "gelu", torch.bfloat16),
    ],
)
def test_triton_matches_float64_reference(tokens, hidden, inter, experts, top_k, activation, dtype):
    x, w13, w2 = make_moe(tokens, hidden, inter, experts, dtype)
    weights, ids = random_routing(tokens, experts, top_k)
    expected = float64_reference(x, w13, w2, weights, ids, activation)
    out = torch.full_like(x, float("nan"))  # poisoned: an element the kernel skips fails
    result = fused_moe_triton(x, w13, w2, weights, ids, activation, out=out)
    assert result is out
    assert_close_to_scale(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_with_idle_experts_and_all_tokens_on_one_expert(dtype):
    tokens, hidden, inter, experts = 33, 72, 48, 8
    x, w13, w2 = make_moe(tokens, hidden, inter, experts, dtype)

    # Only experts 1 and 6 receive tokens; the other six get no blocks at all.
    weights, ids = random_routing(tokens, 2, 2)
    ids = torch.tensor([1, 6], dtype=torch.int32)[ids.long()]
    expected = float64_reference(x, w13, w2, weights, ids, "silu")
    out = torch.full_like(x, float("nan"))
    assert_close_to_scale(
        fused_moe_triton(x, w13, w2, weights, ids, "silu", out=out), expected, dtype
    )

    # Every token on expert 3, top_k=1: 33 rows span three 16-row blocks of one expert.
    ids = torch.full((tokens, 1), 3, dtype=torch.int32)
    weights = torch.rand(tokens, 1)
    expected = float64_reference(x, w13, w2, weights, ids, "gelu")
    out = torch.full_like(x, float("nan"))
    assert_close_to_scale(
        fused_moe_triton(x, w13, w2, weights, ids, "gelu", out=out), expected, dtype
    )


def test_triton_allocates_the_output_when_none_is_given():
    x, w13, w2 = make_moe(5, 64, 48, 4, torch.bfloat16)
    weights, ids = random_routing(5, 4, 2)
    result = fused_moe_triton(x, w13, w2, weights, ids)
    assert result.shape == x.shape and result.dtype == torch.bfloat16
    assert_close_to_scale(result, float64_reference(x, w13, w2, weights, ids, "silu"), x.dtype)


def test_shape_mismatches_are_rejected():
    x, w13, w2 = make_moe(4, 64, 48, 4, torch.float32)
    weights, ids = random_routing(4, 4, 2)
    for fn in (fused_moe_torch, fused_moe_triton):
        with pytest.raises(ValueError, match="w2"):
            fn(x, w13, w2[:, :, :40], weights, ids)
        with pytest.raises(ValueError, match="activation"):
            fn(x, w13, w2, weights, ids, "relu")
        with pytest.raises(ValueError, match="out"):
            fn(x, w13, w2, weights, ids, out=torch.empty(4, 64, dtype=torch.bfloat16))

"""The MoE router: the Triton kernel (under the interpreter) against the PyTorch reference and
against a float64 routing written out here one token at a time, and both paths against Hugging
Face's DeepSeek-V3 router, on fresh random inputs each run."""

from __future__ import annotations

import os

# Must precede the import of the module holding the @triton.jit kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from kernels.moe_router import select_experts_torch, select_experts_triton

# The weights, either path against float64 and against each other. Logits of every dtype
# convert to float32 exactly, so the only error is float32 rounding: exp or sigmoid, a softmax
# sum of up to 384 terms, the renormalising sum and division, the scaling. The worst seen over
# 8,400 random tokens of these routers was 2.7e-7 relative to float64 and 3.5e-7 between the
# paths; rtol 2e-6 leaves a 5x margin, and atol covers unnormalised softmax weights near zero.
WEIGHT_TOLERANCE = {"atol": 1e-8, "rtol": 2e-6}

# Two ranked values closer than this (relative) are a near tie: float32 rounding, which differs
# between the paths (their exp differs), could order them either way; about 1 token in 500 of
# these random inputs has one, and is drawn again. Exact ties (equal logits, common in bf16)
# stay, as every path orders them by index.
NEAR_TIE = 1e-5


@dataclass(frozen=True)
class Router:
    """One model's routing configuration."""

    num_experts: int
    top_k: int
    renormalize: bool
    scoring: str = "softmax"
    biased: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    def arguments(self, bias: torch.Tensor | None) -> dict:
        return {
            "top_k": self.top_k,
            "renormalize": self.renormalize,
            "scoring": self.scoring,
            "correction_bias": bias,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
        }


ROUTERS = {
    "mixtral": Router(8, 2, renormalize=True),
    "qwen1.5_moe": Router(60, 4, renormalize=False),
    "deepseek_v2_group_max": Router(160, 6, False, num_expert_group=8, topk_group=3,
                                    routed_scaling_factor=16.0),
    "groups_e8": Router(8, 2, True, "sigmoid", True, 4, 2, 2.5),
    "groups_e64": Router(64, 6, True, "sigmoid", True, 8, 4, 2.5),
    "deepseek_v3": Router(256, 8, True, "sigmoid", True, 8, 4, 2.5),
    "kimi_k2": Router(384, 8, True, "sigmoid", True, 1, 1, 2.5),
}  # fmt: skip


@dataclass
class Float64Routing:
    weights: torch.Tensor  # float64 [T, top_k]
    ids: torch.Tensor  # int64 [T, top_k]
    near_tie: torch.Tensor  # bool [T]


def is_near_tie(higher: float, lower: float) -> bool:
    return 0 < higher - lower <= NEAR_TIE * max(abs(higher), abs(lower))


def float64_routing(logits: torch.Tensor, router: Router, bias: torch.Tensor | None):
    """The routing in float64, written out per token from the models' definitions (DeepSeek-V3's
    `noaux_tc`, DeepSeek-V2's group-limited greedy); equal values rank lower index first."""
    logits = logits.double()
    scores = logits.softmax(-1) if router.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.double()
    num_tokens, num_experts = logits.shape
    weights, ids, near_tie = [], [], []
    for token_scores, token_choice in zip(scores.tolist(), choice.tolist(), strict=True):
        eligible = list(range(num_experts))
        near = False
        if router.num_expert_group is not None:
            size = num_experts // router.num_expert_group
            members = [eligible[g * size : (g + 1) * size] for g in range(router.num_expert_group)]
            group_scores = []
            for group in members:
                best = sorted((token_choice[e] for e in group), reverse=True)
                group_scores.append(sum(best[:2]) if bias is not None else best[0])
            ranked = sorted(range(len(members)), key=lambda g: (-group_scores[g], g))
            if router.topk_group < len(members):
                boundary = ranked[router.topk_group - 1 : router.topk_group + 1]
                near |= is_near_tie(*(group_scores[g] for g in boundary))
            eligible = sorted(e for g in ranked[: router.topk_group] for e in members[g])
        ranked = sorted(eligible, key=lambda e: (-token_choice[e], e))
        chosen_values = [token_choice[e] for e in ranked[: router.top_k + 1]]
        near |= any(map(is_near_tie, chosen_values, chosen_values[1:]))
        chosen = ranked[: router.top_k]
        token_weights = [token_scores[e] for e in chosen]
        if router.renormalize:
            token_weights = [w / sum(token_weights) for w in token_weights]
        weights.append([w * router.routed_scaling_factor for w in token_weights])
        ids.append(chosen)
        near_tie.append(near)
    return Float64Routing(
        torch.tensor(weights, dtype=torch.float64).view(num_tokens, router.top_k),
        torch.tensor(ids, dtype=torch.int64).view(num_tokens, router.top_k),
        torch.tensor(near_tie, dtype=torch.bool),
    )


def draw_without_near_ties(
    draw: Callable[[int], torch.Tensor],
    to_logits: Callable[[torch.Tensor], torch.Tensor],
    tokens: int,
    router: Router,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`tokens` rows from `draw`, those whose logits rank with a near tie drawn again."""
    rows = draw(tokens)
    for _ in range(100):
        near_tie = float64_routing(to_logits(rows), router, bias).near_tie
        if not near_tie.any():
            return rows
        rows[near_tie] = draw(int(near_tie.sum()))
    raise AssertionError("no draw without near ties in 100 tries")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("name", ROUTERS)
def test_triton_router_matches_the_reference_and_float64(name, tokens, dtype):
    router = ROUTERS[name]
    experts = router.num_experts
    bias = torch.randn(experts) * 0.1 if router.biased else None
    rows = draw_without_near_ties(
        lambda n: torch.randn(n, experts).to(dtype), lambda r: r, tokens, router, bias
    )
    # Rows padded with NaN past E: a kernel that read beyond its row would return NaN weights.
    padded = torch.full((tokens, experts + 3), float("nan"), dtype=dtype)
    padded[:, :experts] = rows
    logits = padded[:, :experts]
    expected = float64_routing(logits, router, bias)

    weights, ids = select_experts_triton(logits, **router.arguments(bias))
    reference_weights, reference_ids = select_experts_torch(logits, **router.arguments(bias))

    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, reference_ids)
    assert torch.equal(ids.long(), expected.ids)
    torch.testing.assert_close(weights.double(), expected.weights, **WEIGHT_TOLERANCE)
    torch.testing.assert_close(reference_weights.double(), expected.weights, **WEIGHT_TOLERANCE)
    torch.testing.assert_close(weights, reference_weights, **WEIGHT_TOLERANCE)


def sorted_by_expert(weights: torch.Tensor, ids: torch.Tensor):
    """HF's DeepSeek router uses topk(sorted=False): compare each token's choices as a set."""
    ids, order = ids.long().sort(dim=-1)
    return weights.gather(1, order), ids


def test_both_paths_match_the_hugging_face_deepseek_v3_router():
    router_config = ROUTERS["groups_e64"]
    hidden = 48
    config = DeepseekV3Config(
        hidden_size=hidden,
        n_routed_experts=router_config.num_experts,
        num_experts_per_tok=router_config.top_k,
        n_group=router_config.num_expert_group,
        topk_group=router_config.topk_group,
        routed_scaling_factor=router_config.routed_scaling_factor,
        norm_topk_prob=True,
    )
    hf_router = DeepseekV3TopkRouter(config)
    hf_router.weight.data = torch.randn(router_config.num_experts, hidden) / hidden**0.5
    hf_router.e_score_correction_bias.data = torch.randn(router_config.num_experts) * 0.1
    bias = hf_router.e_score_correction_bias
    hidden_states = draw_without_near_ties(
        lambda n: torch.randn(n, hidden),
        lambda h: F.linear(h, hf_router.weight),
        33,
        router_config,
        bias,
    )
    logits, hf_weights, hf_ids = hf_router(hidden_states)
    hf_weights, hf_ids = sorted_by_expert(hf_weights, hf_ids)
    for select_experts in (select_experts_torch, select_experts_triton):
        weights, ids = sorted_by_expert(*select_experts(logits, **router_config.arguments(bias)))
        assert torch.equal(ids, hf_ids), select_experts.__name__
        # HF sums the weights in its unsorted topk's order: equal to float32 rounding.
        torch.testing.assert_close(weights, hf_weights, **WEIGHT_TOLERANCE)


@pytest.mark.parametrize("select_experts", [select_experts_torch, select_experts_triton])
def test_equal_scores_go_to_the_lower_expert_index(select_experts):
    logits = torch.zeros(3, 16, dtype=torch.bfloat16)
    logits[1, 9:] = 1.0  # experts 9..15 tie above the rest
    _, ids = select_experts(logits, 4, renormalize=True)
    assert ids.tolist() == [[0, 1, 2, 3], [9, 10, 11, 12], [0, 1, 2, 3]]
    # Every group scores the same: the lowest two groups are kept.
    _, ids = select_experts(
        logits[[0]],
        3,
        renormalize=True,
        scoring="sigmoid",
        correction_bias=torch.zeros(16),
        num_expert_group=4,
        topk_group=2,
    )
    assert ids.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("select_experts", [select_experts_torch, select_experts_triton])
def test_no_tokens_route_to_empty_tensors(select_experts):
    weights, ids = select_experts(torch.empty(0, 64), 6, renormalize=True)
    assert weights.shape == ids.shape == (0, 6)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32


@pytest.mark.parametrize("select_experts", [select_experts_torch, select_experts_triton])
@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"top_k": 9}, "top_k must be in"),
        ({"scoring": "relu"}, "scoring must be"),
        ({"num_expert_group": 4, "topk_group": 5}, "topk_group must be in"),
        ({"num_expert_group": 3, "topk_group": 1}, "do not split"),
        ({"num_expert_group": 4, "topk_group": 1, "top_k": 3}, "exceeds the 2 eligible"),
    ],
)
def test_invalid_routing_is_refused(select_experts, arguments, message):
    with pytest.raises(ValueError, match=message):
        select_experts(torch.randn(2, 8), **{"top_k": 2, "renormalize": True, **arguments})

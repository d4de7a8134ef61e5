"""MoE routing: router logits [T, E] to each token's top-k experts and their weights.

`select_experts_torch` is the reference; `select_experts_triton` does the whole router in one
launch, one program per token: it loads the token's E logits (E = 384 for Kimi K2, 256 for
DeepSeek-V3, one block of next_pow2(E)), scores them, masks the experts outside the best groups
and takes the top k by k rounds of argmax-and-mask, all in float32 registers. The reference
spends a dozen launches on the same [T, E] work (the scores, the biased copy, the group top-2,
two sorts, a scatter, a gather, the renormalisation), each of which a decode step pays for in
launch latency.

Ties are broken towards the lower index in both paths, for the kept groups and for the experts.
`torch.topk` leaves the order of equal values unspecified and on the CPU does not keep the lower
index (k=4 of ten zeros gives ids 8, 6, 7, 5 in torch 2.13), so no kernel could match it; the
reference ranks with a stable descending sort instead. Ties are common: bf16 logits take few
distinct values, and equal logits give equal scores. Apart from ties, the two paths compute exp
differently (a GPU's is approximate), so their weights agree to float32 rounding, and their ids
agree except where two choice scores are within that rounding of each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.batch_invariance import sigmoid

_SCORINGS = ("softmax", "sigmoid")


def _check_routing(
    num_experts: int,
    top_k: int,
    scoring: str,
    num_expert_group: int | None,
    topk_group: int | None,
) -> None:
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if scoring not in _SCORINGS:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if num_expert_group is None:
        return
    if topk_group is None or not 0 < topk_group <= num_expert_group:
        raise ValueError(f"topk_group must be in [1, {num_expert_group}], got {topk_group}")
    if num_experts % num_expert_group:
        raise ValueError(f"{num_experts} experts do not split into {num_expert_group} groups")
    eligible = topk_group * (num_experts // num_expert_group)
    if top_k > eligible:
        raise ValueError(f"top_k={top_k} exceeds the {eligible} eligible")


def _top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of each row's k largest values, largest first, equal values lower index first."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def select_experts_torch(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of each token to experts; plain PyTorch, the reference and CPU path.

    `router_logits` [T, E] are scored in float32 by `scoring` ("softmax" over the experts, as
    Mixtral and Qwen2-MoE do, or "sigmoid" per expert, as DeepSeek-V3 does). `correction_bias`
    [E] is added to the scores only to *choose* experts; the weights are the unbiased scores
    (DeepSeek-V3's aux-loss-free balancing). With `num_expert_group`, experts are split into
    that many equal groups, only the best `topk_group` groups stay eligible, and the top_k are
    chosen among their experts. A group's score is the sum of its two best biased scores when
    `correction_bias` is given (DeepSeek-V3, "noaux_tc") and its best score otherwise
    (DeepSeek-V2, "group_limited_greedy"), as Hugging Face and vLLM do.

    `renormalize` rescales each token's k weights to sum to 1 (Mixtral always; Qwen2-MoE's and
    DeepSeek's `norm_topk_prob`). The weights are then multiplied by `routed_scaling_factor`.

    Returns (topk_weights float32 [T, top_k], topk_ids int32 [T, top_k]), each row ordered by
    descending choice score, equal scores lower expert id first (see the module docstring).
    """
    _check_routing(router_logits.shape[-1], top_k, scoring, num_expert_group, topk_group)
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else sigmoid(logits)

    choice_scores = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None:
        choice_scores = _mask_to_best_groups(
            choice_scores, num_expert_group, topk_group, use_top2_sum=correction_bias is not None
        )

    topk_ids = _top_indices(choice_scores, top_k)
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        # The 1e-20 only guards against all-underflowed sigmoid scores (0/0); added to a sum of
        # k probabilities it leaves the float32 result bit-identical to Hugging Face's.
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int32)


def _mask_to_best_groups(
    choice_scores: torch.Tensor, num_expert_group: int, topk_group: int, use_top2_sum: bool
) -> torch.Tensor:
    """Set the choice score of experts outside each token's best `topk_group` groups to -inf."""
    num_tokens, num_experts = choice_scores.shape
    experts_per_group = num_experts // num_expert_group
    grouped = choice_scores.view(num_tokens, num_expert_group, experts_per_group)
    if use_top2_sum:
        # Only the values are used, which do not depend on how ties are ordered.
        group_scores = grouped.topk(min(2, experts_per_group), dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    kept_groups = _top_indices(group_scores, topk_group)
    group_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_kept = group_kept.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return choice_scores.masked_fill(~expert_kept, float("-inf"))


@triton.jit
def _select_experts_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    logits_row_stride,
    routed_scaling_factor,
    TOP_K: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    EXPERTS_PER_GROUP: tl.constexpr,
    GROUP_SCORE_TOP2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    real = experts < num_experts
    # Loaded in the logits' dtype and converted at once: all arithmetic is float32, which the
    # interpreter computes correctly (it does not for bf16/fp16).
    logits = tl.load(
        logits_ptr + token * logits_row_stride + experts, mask=real, other=float("-inf")
    ).to(tl.float32)
    if SOFTMAX:
        exps = tl.exp(logits - tl.max(logits, axis=0))  # padding: exp(-inf) = 0
        scores = exps / tl.sum(exps, axis=0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + experts, mask=real, other=0.0).to(tl.float32)
    choice = tl.where(real, choice, float("-inf"))

    if NUM_GROUPS > 1:
        # [groups, experts] with each row holding only its group's choice scores; the padding
        # experts' group index is >= NUM_GROUPS, so they belong to no real group.
        groups = tl.arange(0, BLOCK_G)
        group_of_expert = experts // EXPERTS_PER_GROUP
        in_group = group_of_expert[None, :] == groups[:, None]
        grouped = tl.where(in_group, choice[None, :], float("-inf"))
        group_scores = tl.max(grouped, axis=1)
        if GROUP_SCORE_TOP2:
            best_in_group = tl.argmax(grouped, axis=1)
            not_best = experts[None, :] != best_in_group[:, None]
            group_scores += tl.max(tl.where(not_best, grouped, float("-inf")), axis=1)
        group_scores = tl.where(groups < NUM_GROUPS, group_scores, float("-inf"))
        kept = tl.zeros([BLOCK_E], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            # argmax returns the lowest index among equal maxima: the reference's tie order.
            best_group = tl.argmax(group_scores, axis=0)
            kept = tl.where(group_of_expert == best_group, 1, kept)
            group_scores = tl.where(groups == best_group, float("-inf"), group_scores)
        choice = tl.where(kept != 0, choice, float("-inf"))

    slots = tl.arange(0, BLOCK_K)
    topk_weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    topk_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)
        # The unbiased score of the chosen expert: a sum of one score and zeros, exact.
        weight = tl.sum(tl.where(experts == best, scores, 0.0), axis=0)
        topk_ids = tl.where(slots == slot, best, topk_ids)
        topk_weights = tl.where(slots == slot, weight, topk_weights)
        choice = tl.where(experts == best, float("-inf"), choice)
    if RENORMALIZE:
        topk_weights = topk_weights / (tl.sum(topk_weights, axis=0) + 1e-20)
    topk_weights = topk_weights * routed_scaling_factor
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, topk_weights, mask=slots < TOP_K)
    tl.store(ids_ptr + out, topk_ids, mask=slots < TOP_K)


def select_experts_triton(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton top-k routing with the same contract as `select_experts_torch`, in one launch."""
    num_tokens, num_experts = router_logits.shape
    _check_routing(num_experts, top_k, scoring, num_expert_group, topk_group)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    device = router_logits.device
    topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    topk_ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return topk_weights, topk_ids
    # One group keeps every expert, so the kernel skips the group step.
    num_groups = num_expert_group or 1
    experts_per_group = num_experts // num_groups
    block_e = triton.next_power_of_2(num_experts)
    block_g = triton.next_power_of_2(num_groups)
    _select_experts_kernel[(num_tokens,)](
        logits,
        correction_bias.contiguous() if correction_bias is not None else logits,
        topk_weights,
        topk_ids,
        num_experts,
        logits.stride(0),
        float(routed_scaling_factor),
        TOP_K=top_k,
        SOFTMAX=scoring == "softmax",
        HAS_BIAS=correction_bias is not None,
        NUM_GROUPS=num_groups,
        TOPK_GROUP=topk_group if num_groups > 1 else 1,
        EXPERTS_PER_GROUP=experts_per_group,
        GROUP_SCORE_TOP2=correction_bias is not None and experts_per_group >= 2,
        RENORMALIZE=renormalize,
        BLOCK_E=block_e,
        BLOCK_G=block_g,
        BLOCK_K=triton.next_power_of_2(top_k),
        # The [groups, experts] tile of the group step is the largest; 4 warps hold DeepSeek-V3's
        # 8 x 256 at 16 values a thread.
        num_warps=8 if block_g * block_e > 4096 else 4,
    )
    return topk_weights, topk_ids

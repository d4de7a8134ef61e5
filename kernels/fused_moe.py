"""Mixture-of-experts MLP: top-k routing, then each token's gated MLP on its chosen experts.

`kernels.moe_router` turns router logits into (weights, expert ids) per token.
`fused_moe_torch` and `fused_moe_triton` then compute, for every token t,

    out[t] = Σ_k topk_weights[t, k] · w2[e] @ act(w13[e] @ x[t]),   e = topk_ids[t, k]

with `w13[e]` = [gate | up] stacked along its rows, as nn.Linear weights ([E, 2I, H], the
layout Hugging Face's Mixtral/Qwen2-MoE/DeepSeek-V3 experts use), `w2` [E, H, I], and
act(gate, up) = silu(gate) * up (SwiGLU) or gelu(gate) * up (GeGLU, exact erf GELU as
`F.gelu`'s default and HF's "gelu").

Why the Triton path is shaped this way (the vLLM/SGLang design): a token visits only top_k of
E experts, so per-expert dense matmuls waste work and a Python loop over experts costs a
launch per expert. Instead `moe_align_block_size` sorts the T*top_k (token, k) pairs by expert
and pads each expert's group to a multiple of BLOCK_M, so every BLOCK_M block of sorted pairs
belongs to one expert. One grouped-GEMM launch then covers all experts: each program reads its
block's expert id, gathers its BLOCK_M rows of A, streams that expert's weight tile through
`tl.dot`, and scatters the rows back to their pair's output row. Two launches make the MLP:
w13 with the gated activation fused into the epilogue (so the [pairs, 2I] gate/up tensor is
never written), then w2 with the routing weight multiplied in; a sum over k finishes.

On CUDA, bf16/fp16 tiles go straight into `tl.dot` with fp32 accumulation. Under the CPU
interpreter (`TRITON_INTERPRET=1`), low-precision arithmetic and `tl.dot` are computed wrongly
without error, so the kernel casts tiles to fp32 first (`COMPUTE_FP32`); fp32 inputs use an
IEEE fp32 dot everywhere, matching torch's default of no TF32.

`moe_align_block_size` is plain PyTorch on every device: a sort and a scatter over the
T*top_k pairs, tiny beside the expert GEMMs, written to avoid host syncs on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import ACTIVATIONS, activate
from kernels.batch_invariance import matmul_nt, silu

# The gated activations a MoE expert may use (codes from kernels.activation).
_MOE_ACTIVATIONS = ("silu", "gelu")


def _check_moe_shapes(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    out: torch.Tensor | None,
) -> None:
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter, w13_hidden = w13.shape
    if w13_hidden != hidden or two_inter % 2:
        raise ValueError(f"w13 {tuple(w13.shape)} is not [E, 2I, {hidden}]")
    if tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w2 {tuple(w2.shape)} is not {(num_experts, hidden, two_inter // 2)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)}"
            f" must both be [{num_tokens}, top_k]"
        )
    if activation not in _MOE_ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {sorted(_MOE_ACTIVATIONS)}, got {activation!r}"
        )
    if out is not None and (out.shape != hidden_states.shape or out.dtype != hidden_states.dtype):
        raise ValueError(f"out must be {hidden_states.dtype} {tuple(hidden_states.shape)}")


def _gated_activation_torch(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    activated = silu(gate) if activation == "silu" else F.gelu(gate)
    return activated.mul_(up)


def fused_moe_torch(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """MoE MLP, reference and CPU path: a loop over the experts that received tokens.

    hidden_states [T, H]; w13 [E, 2I, H] ([gate | up] rows); w2 [E, H, I]; topk_weights and
    topk_ids [T, top_k] (ids in [0, E)); activation "silu" (SwiGLU) or "gelu" (GeGLU, exact erf
    GELU). The matmuls and activation run in the input dtype (as Hugging Face's experts do;
    torch accumulates low-precision matmuls in fp32); the weighted sum over k accumulates in
    float32 (float64 for float64 input). Returns [T, H] in hidden_states' dtype, written into
    `out` when given.
    """
    _check_moe_shapes(hidden_states, w13, w2, topk_weights, topk_ids, activation, out)
    num_tokens, hidden = hidden_states.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    low_precision = hidden_states.dtype in (torch.bfloat16, torch.float16)
    accumulator = torch.zeros(
        num_tokens,
        hidden,
        dtype=torch.float32 if low_precision else hidden_states.dtype,
        device=hidden_states.device,
    )
    expert_of_pair = topk_ids.flatten().long()
    # One sort groups the (token, k) pairs by expert; the per-expert counts then slice it,
    # so the loop does no per-expert search over all pairs.
    pairs_by_expert = torch.argsort(expert_of_pair, stable=True)
    pairs_per_expert = torch.bincount(expert_of_pair, minlength=num_experts).tolist()
    token_of_sorted_pair = pairs_by_expert // top_k
    weight_of_sorted_pair = topk_weights.flatten()[pairs_by_expert].to(accumulator.dtype)
    start = 0
    for expert, count in enumerate(pairs_per_expert):
        if count == 0:
            continue
        tokens = token_of_sorted_pair[start : start + count]
        x = hidden_states.index_select(0, tokens)
        intermediate = _gated_activation_torch(matmul_nt(x, w13[expert]), activation)
        # In batch-invariant mode an expert's rows keep their bits however many tokens chose it
        # (kernels.batch_invariance.matmul_nt).
        expert_out = matmul_nt(intermediate, w2[expert])
        expert_out = expert_out.to(accumulator.dtype)
        expert_out.mul_(weight_of_sorted_pair[start : start + count, None])
        accumulator.index_add_(0, tokens, expert_out)
        start += count
    if out is None:
        return accumulator.to(hidden_states.dtype)
    return out.copy_(accumulator)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, k) pairs by expert, each group padded to a multiple of `block_m`.

    Plain PyTorch (a sort, a scatter and a search over [T*top_k] ints, small beside the GEMMs).
    Pair p is token p // top_k's k-th choice, i.e. the flat index into `topk_ids`. Returns:

    - `sorted_token_ids` int32 [T*top_k + E*(block_m-1)]: pair indices, expert 0's first, each
      expert's group followed by sentinel pairs (value T*top_k) up to a multiple of `block_m`,
      then sentinels to the end. The length is the worst case, so it is known without reading
      the counts back to the host (no sync on CUDA).
    - `expert_ids` int32 [len // block_m rounded up]: the expert of each block of `block_m`
      entries; -1 for blocks past the padded total, which the kernel never runs.
    - `num_tokens_post_padded` int32 [1]: the padded total, Σ_e ceil(count_e / block_m) *
      block_m; experts without pairs take no blocks.
    """
    device = topk_ids.device
    expert_of_pair = topk_ids.flatten().long()
    num_pairs = expert_of_pair.numel()
    # scatter_add_ rather than bincount: bincount reads the max back to the host on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, expert_of_pair, torch.ones_like(expert_of_pair))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, dim=0)
    padded_starts = padded_ends - padded_counts
    unpadded_starts = torch.cumsum(counts, dim=0) - counts

    pairs_by_expert = torch.argsort(expert_of_pair, stable=True)
    sorted_experts = expert_of_pair[pairs_by_expert]
    rank_in_expert = torch.arange(num_pairs, device=device) - unpadded_starts[sorted_experts]
    destination = padded_starts[sorted_experts] + rank_in_expert

    max_padded = num_pairs + num_experts * (block_m - 1)
    sorted_token_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, destination, pairs_by_expert.to(torch.int32))

    block_starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    num_tokens_post_padded = padded_ends[-1:].to(torch.int32)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    EM,
    num_pairs,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    A_ROWS_DIVISOR: tl.constexpr,
    ACTIVATION: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C[pair, n] = A[pair // A_ROWS_DIVISOR] · B[expert(pair)][n, :] for one tile.

    B is [E, N, K] (nn.Linear weights). With ACTIVATION (1 silu, 2 gelu), B holds [gate | up]
    as [E, 2N, K] and the tile is act(A·gate) * (A·up): C is then [pairs, N].
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped launch order: GROUP_M consecutive row blocks (mostly one expert) sweep the N
    # tiles together, so an expert's weight tiles are reused from L2 rather than HBM.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # The grid is sized for the worst-case padding; blocks past the real total have no work.
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return

    offs_sorted = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_token_ids_ptr + offs_sorted).to(tl.int64)
    pair_mask = pair < num_pairs  # padding rows hold the sentinel num_pairs
    # int64: expert * stride_be overflows int32 for large models (256 experts × 7168 × 4096).
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrap out-of-range columns onto valid rows of B so its loads need no N mask; those
    # columns are masked off at the store.
    offs_bn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair[:, None] // A_ROWS_DIVISOR) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_bn[None, :] * stride_bn + offs_k[:, None] * stride_bk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # unused (and dropped) if ungated
    for k_start in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k_start
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if COMPUTE_FP32:
            a = a.to(tl.float32)
            acc = tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if ACTIVATION != 0:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None], other=0.0)
            if COMPUTE_FP32:
                acc_up = tl.dot(a, b_up.to(tl.float32), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # The activation runs on the fp32 accumulators, before any rounding to the output dtype.
    if ACTIVATION != 0:
        acc = activate(acc, ACTIVATION) * acc_up
    if MUL_ROUTED_WEIGHT:
        routing_weight = tl.load(topk_weights_ptr + pair, mask=pair_mask, other=0.0)
        acc = acc * routing_weight.to(tl.float32)[:, None]

    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = pair_mask[:, None] & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@dataclass(frozen=True)
class _TileConfig:
    block_m: int
    block_n_gated: int  # w13 launch: two accumulators (gate, up), so half the width of w2's
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def _tile_config(num_pairs: int, num_experts: int) -> _TileConfig:
    """Default tiles for an H100/H200-class GPU (untuned defaults, not a searched table)."""
    if num_pairs <= 32 * num_experts:
        # Few pairs per expert (decode): 64-row blocks would be mostly padding, and the GEMM
        # is bound by reading the weights anyway.
        return _TileConfig(16, 64, 64, 128, 1, 4, 3)
    return _TileConfig(64, 64, 128, 64, 8, 8, 3)


def _launch_grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_rows_divisor: int,
    activation: int,
    mul_routed_weight: bool,
    block_n: int,
    config: _TileConfig,
) -> None:
    sorted_token_ids, expert_ids, num_tokens_post_padded = routing
    n = c.shape[1]
    k = a.shape[1]
    em = sorted_token_ids.numel()
    grid = (triton.cdiv(em, config.block_m) * triton.cdiv(n, block_n),)
    _grouped_gemm_kernel[grid](
        a,
        b,
        c,
        topk_weights,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        n,
        k,
        em,
        c.shape[0],
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        A_ROWS_DIVISOR=a_rows_divisor,
        ACTIVATION=activation,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        COMPUTE_FP32=not a.is_cuda or a.dtype == torch.float32,
        BLOCK_M=config.block_m,
        BLOCK_N=block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fused_moe_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """MoE MLP with two grouped-GEMM Triton launches; same contract as `fused_moe_torch`.

    The [T*top_k, I] activated intermediate and the [T*top_k, H] weighted expert outputs are
    held in hidden_states' dtype (as vLLM does; halves their traffic), each computed from fp32
    accumulators; the sum over k is torch's, which accumulates low precision in fp32.
    """
    _check_moe_shapes(hidden_states, w13, w2, topk_weights, topk_ids, activation, out)
    num_tokens, hidden = hidden_states.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if out is None:
        out = torch.empty_like(hidden_states)
    if num_tokens == 0:
        return out
    config = _tile_config(num_pairs, num_experts)
    routing = moe_align_block_size(topk_ids, config.block_m, num_experts)
    topk_weights = topk_weights.contiguous()

    intermediate = hidden_states.new_empty(num_pairs, inter)
    _launch_grouped_gemm(
        hidden_states,
        w13,
        intermediate,
        topk_weights,
        routing,
        a_rows_divisor=top_k,
        activation=ACTIVATIONS[activation],
        mul_routed_weight=False,
        block_n=config.block_n_gated,
        config=config,
    )
    expert_outputs = hidden_states.new_empty(num_pairs, hidden)
    _launch_grouped_gemm(
        intermediate,
        w2,
        expert_outputs,
        topk_weights,
        routing,
        a_rows_divisor=1,
        activation=0,
        mul_routed_weight=True,
        block_n=config.block_n,
        config=config,
    )
    return torch.sum(expert_outputs.view(num_tokens, top_k, hidden), dim=1, out=out)

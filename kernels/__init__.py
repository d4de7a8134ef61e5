"""Hearth's compute ops. Each op dispatches (see `dispatch`) to a Triton kernel or its PyTorch
reference; the engine calls only these functions. Imports nothing from `inference`."""

from __future__ import annotations

# dispatch first: it sets TRITON_INTERPRET, when asked to, before any kernel is defined.
from kernels import dispatch  # isort: skip

import torch

from kernels.activation import (
    gelu_and_mul_torch,
    gelu_and_mul_triton,
    silu_and_mul_invariant,
    silu_and_mul_torch,
    silu_and_mul_triton,
)
from kernels.attention import (
    PagedAttentionBatch,
    PrefillSegment,
    build_paged_attention_batch,
    paged_attention_torch,
    paged_attention_triton,
    store_kvcache_torch,
    store_kvcache_triton,
)
from kernels.batch_invariance import batch_invariant, is_batch_invariant, sigmoid
from kernels.fused_moe import fused_moe_torch, fused_moe_triton
from kernels.invariant_attention import paged_attention_invariant_torch
from kernels.linear import Int4Weight, linear_torch, pack_linear_weight
from kernels.mla_attention import (
    mla_decode_torch,
    mla_decode_triton,
    mla_prefill_torch,
    mla_prefill_triton,
    store_latent_torch,
    store_latent_triton,
)
from kernels.moe_router import select_experts_torch, select_experts_triton
from kernels.rms_norm import rms_norm_torch, rms_norm_triton
from kernels.rotary import build_cos_sin_cache, rotary_cos_sin, rotary_torch, rotary_triton

__all__ = [
    "Int4Weight",
    "PagedAttentionBatch",
    "PrefillSegment",
    "attention",
    "batch_invariant",
    "build_cos_sin_cache",
    "build_paged_attention_batch",
    "fused_moe",
    "gelu_and_mul",
    "is_batch_invariant",
    "linear",
    "mla_decode",
    "mla_prefill",
    "pack_linear_weight",
    "rms_norm",
    "rotary",
    "rotary_cos_sin",
    "select_experts",
    "sigmoid",
    "silu_and_mul",
    "store_kvcache",
    "store_latent",
]

RMS_NORM = dispatch.Op("rms_norm", rms_norm_torch, rms_norm_triton)
ROTARY = dispatch.Op("rotary", rotary_torch, rotary_triton)
SILU_AND_MUL = dispatch.Op(
    "silu_and_mul", silu_and_mul_torch, silu_and_mul_triton, silu_and_mul_invariant
)
GELU_AND_MUL = dispatch.Op("gelu_and_mul", gelu_and_mul_torch, gelu_and_mul_triton)
LINEAR = dispatch.Op("linear", linear_torch)
STORE_KVCACHE = dispatch.Op("store_kvcache", store_kvcache_torch, store_kvcache_triton)
ATTENTION = dispatch.Op(
    "attention", paged_attention_torch, paged_attention_triton, paged_attention_invariant_torch
)
SELECT_EXPERTS = dispatch.Op("select_experts", select_experts_torch, select_experts_triton)
FUSED_MOE = dispatch.Op("fused_moe", fused_moe_torch, fused_moe_triton)
STORE_LATENT = dispatch.Op("store_latent", store_latent_torch, store_latent_triton)
MLA_DECODE = dispatch.Op("mla_decode", mla_decode_torch, mla_decode_triton)
MLA_PREFILL = dispatch.Op("mla_prefill", mla_prefill_torch, mla_prefill_triton)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm, fused with the residual add when `residual` is given. See `kernels.rms_norm`."""
    return dispatch.select(RMS_NORM, x)(x, weight, eps, residual)


def rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
) -> None:
    """Apply rotary embeddings to query and key in place. See `kernels.rotary`."""
    dispatch.select(ROTARY, query)(query, key, cos, sin, interleaved)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on x = [gate | up]. See `kernels.activation`."""
    return dispatch.select(SILU_AND_MUL, x)(x)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeGLU on x = [gate | up]. See `kernels.activation`."""
    return dispatch.select(GELU_AND_MUL, x)(x, approximate)


def linear(
    x: torch.Tensor, weight: torch.Tensor | Int4Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Dense projection. See `kernels.linear`."""
    return dispatch.select(LINEAR, x)(x, weight, bias)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys/values into the paged cache. See `kernels.attention`."""
    dispatch.select(STORE_KVCACHE, key)(key, value, k_cache, v_cache, slot_mapping)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedAttentionBatch,
    scale: float,
) -> torch.Tensor:
    """Paged causal attention for one step. See `kernels.attention`."""
    fn = dispatch.select(ATTENTION, query)
    return fn(query, key, value, k_cache, v_cache, batch, scale)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and their weights from its router logits. See
    `kernels.moe_router`."""
    fn = dispatch.select(SELECT_EXPERTS, router_logits)
    return fn(
        router_logits,
        top_k,
        renormalize,
        scoring,
        correction_bias,
        num_expert_group,
        topk_group,
        routed_scaling_factor,
    )


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Mixture-of-experts MLP over the experts `select_experts` chose. See `kernels.fused_moe`."""
    fn = dispatch.select(FUSED_MOE, hidden_states)
    return fn(hidden_states, w13, w2, topk_weights, topk_ids, activation)


def store_latent(
    latent: torch.Tensor, rope_key: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write MLA's per-token [latent | rope key] rows into the latent cache. See
    `kernels.mla_attention`."""
    dispatch.select(STORE_LATENT, latent)(latent, rope_key, cache, slot_mapping)


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    batch: PagedAttentionBatch,
    scale: float,
) -> torch.Tensor:
    """Absorbed-form MLA attention of the step's decoding sequences over the latent cache. See
    `kernels.mla_attention`."""
    return dispatch.select(MLA_DECODE, q_latent)(q_latent, q_rope, cache, batch, scale)


def mla_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    key_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the step's prefills over their decompressed contexts. See
    `kernels.mla_attention`."""
    fn = dispatch.select(MLA_PREFILL, query)
    return fn(query, key, value, query_start_loc, key_start_loc, scale)

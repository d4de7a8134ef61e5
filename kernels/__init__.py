"""Hearth's compute ops. Each op dispatches (see `dispatch`) to a Triton kernel or its PyTorch
reference; the engine calls only these functions. Imports nothing from `inference`."""

from __future__ import annotations

import torch

from kernels import dispatch
from kernels.activation import silu_and_mul_torch
from kernels.attention import (
    PagedAttentionBatch,
    PrefillSegment,
    build_paged_attention_batch,
    paged_attention_torch,
    store_kvcache_torch,
)
from kernels.linear import Int4Weight, linear_torch, pack_linear_weight
from kernels.rms_norm import rms_norm_torch
from kernels.rotary import build_cos_sin_cache, rotary_cos_sin, rotary_torch

__all__ = [
    "Int4Weight",
    "PagedAttentionBatch",
    "PrefillSegment",
    "attention",
    "build_cos_sin_cache",
    "build_paged_attention_batch",
    "linear",
    "pack_linear_weight",
    "rms_norm",
    "rotary",
    "rotary_cos_sin",
    "silu_and_mul",
    "store_kvcache",
]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm, fused with the residual add when `residual` is given. See `kernels.rms_norm`."""
    return dispatch.select("rms_norm", rms_norm_torch, x)(x, weight, eps, residual)


def rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Apply rotary embeddings to query and key in place. See `kernels.rotary`."""
    dispatch.select("rotary", rotary_torch, query)(query, key, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on x = [gate | up]. See `kernels.activation`."""
    return dispatch.select("silu_and_mul", silu_and_mul_torch, x)(x)


def linear(
    x: torch.Tensor, weight: torch.Tensor | Int4Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Dense projection. See `kernels.linear`."""
    return dispatch.select("linear", linear_torch, x)(x, weight, bias)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys/values into the paged cache. See `kernels.attention`."""
    fn = dispatch.select("store_kvcache", store_kvcache_torch, key)
    fn(key, value, k_cache, v_cache, slot_mapping)


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
    fn = dispatch.select("attention", paged_attention_torch, query)
    return fn(query, key, value, k_cache, v_cache, batch, scale)

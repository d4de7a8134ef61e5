"""Rotary position embedding (NeoX / Hugging Face `rotate_half` layout), applied in place."""

from __future__ import annotations

import torch


def build_cos_sin_cache(
    inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Precompute cos and sin tables of shape [max_positions, rotary_dim] in float32.

    `inv_freq` already includes any rope scaling (linear, llama3, yarn, ...); `attention_scaling`
    is the extra factor some scalings (yarn) apply to cos and sin.
    """
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.to(torch.float32))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def rotary_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Rotate query [T, Hq, D] and key [T, Hk, D] in place for token positions [T].

    Works on the two halves in place (x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin), which is
    what `x * cos + rotate_half(x) * sin` computes, rounding for rounding, in about half the
    memory traffic.
    """
    half = query.shape[-1] // 2
    cos = cos_cache.index_select(0, positions)[:, :half].to(query.dtype).unsqueeze(1)
    sin = sin_cache.index_select(0, positions)[:, :half].to(query.dtype).unsqueeze(1)
    for x in (query, key):
        x1, x2 = x[..., :half], x[..., half:]
        x1_sin = x1 * sin
        x1.mul_(cos).sub_(x2 * sin)
        x2.mul_(cos).add_(x1_sin)

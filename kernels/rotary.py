"""Rotary position embedding (NeoX / Hugging Face `rotate_half` layout), applied in place.

Dimension i of a head pairs with dimension i + D/2 and the pair turns by position × inv_freq[i].
The per-token tables are gathered once per step (`rotary_cos_sin`) and shared by every layer.
"""

from __future__ import annotations

import torch


def build_cos_sin_cache(
    inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, rotary_dim / 2] in float32.

    `inv_freq` already includes any rope scaling (linear, llama3, yarn, ...); `attention_scaling`
    is the extra factor some scalings (yarn) apply to cos and sin.
    """
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.to(torch.float32))
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


def rotary_cos_sin(
    cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token tables [T, 1, rotary_dim / 2] in `dtype` for `positions` [T]."""
    cos = cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
    sin = sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
    return cos, sin


def rotary_torch(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate query [T, Hq, D] and key [T, Hk, D] in place with per-token tables [T, 1, D/2].

    Works on the two halves in place (x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin): the same
    roundings as Hugging Face's `x * cos + rotate_half(x) * sin`, with half the memory traffic.
    """
    half = cos.shape[-1]
    for x in (query, key):
        x1, x2 = x[..., :half], x[..., half:]
        x1_sin = x1 * sin
        x1.mul_(cos).sub_(x2 * sin)
        x2.mul_(cos).add_(x1_sin)

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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Rotate query [T, Hq, D] and key [T, Hk, D] in place for token positions [T]."""
    cos = cos_cache.index_select(0, positions).to(query.dtype).unsqueeze(1)
    sin = sin_cache.index_select(0, positions).to(query.dtype).unsqueeze(1)
    query.copy_(query * cos + _rotate_half(query) * sin)
    key.copy_(key * cos + _rotate_half(key) * sin)

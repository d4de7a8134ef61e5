"""The paged KV cache tensors, allocated once from a memory budget."""

from __future__ import annotations

import torch

from inference.models.model_config import ModelConfig


def num_blocks_for_budget(
    config: ModelConfig, dtype: torch.dtype, block_size: int, memory_bytes: int
) -> int:
    """How many blocks of `block_size` tokens fit in `memory_bytes` across all layers."""
    return memory_bytes // (config.kv_bytes_per_token(dtype) * block_size)


def allocate_kv_cache(
    config: ModelConfig, dtype: torch.dtype, num_blocks: int, block_size: int, device: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, a key and a value cache of shape [num_blocks, block_size, kv_heads, head_dim]."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_layers)
    ]

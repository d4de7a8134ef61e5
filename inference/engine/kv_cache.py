"""The paged KV cache tensors, allocated once from a memory budget.

Every layer's key and value caches are views of one buffer, laid out as
[layer, key or value, block, token in block, kv head, head dim]: one block of one layer's keys is
one contiguous run of bytes, and so is a run of consecutive blocks. Disaggregated prefill
registers the buffer with the transfer engine once and writes a peer's blocks at their offsets
(`block_offset`).
"""

from __future__ import annotations

import torch

from inference.models.model_config import ModelConfig


def num_blocks_for_budget(
    config: ModelConfig, dtype: torch.dtype, block_size: int, memory_bytes: int
) -> int:
    """How many blocks of `block_size` tokens fit in `memory_bytes` across all layers."""
    return memory_bytes // (config.kv_bytes_per_token(dtype) * block_size)


def allocate_kv_buffer(
    config: ModelConfig, dtype: torch.dtype, num_blocks: int, block_size: int, device: str
) -> torch.Tensor:
    """The whole cache: [layers, 2, num_blocks, block_size, kv_heads, head_dim], zeroed."""
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def layer_caches(buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the key and the value cache of shape [num_blocks, block_size, kv_heads,
    head_dim]: contiguous views of `buffer`."""
    return [(buffer[layer, 0], buffer[layer, 1]) for layer in range(buffer.shape[0])]


def block_offset(layer: int, kind: int, block: int, num_blocks: int, block_bytes: int) -> int:
    """Byte offset in the buffer of block `block` of layer `layer`'s keys (kind 0) or values
    (kind 1), for a buffer of `num_blocks` blocks of `block_bytes` bytes per layer and kind."""
    return ((layer * 2 + kind) * num_blocks + block) * block_bytes

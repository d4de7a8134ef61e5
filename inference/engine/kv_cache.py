"""The paged KV cache tensors, allocated once from a memory budget.

Every layer's caches are views of one buffer, laid out as
[layer, kind, block, token in block, head, dim] (`ModelConfig.kv_cache_shape`): kinds are keys
and values per KV head for Llama-family attention, one latent row [c | kr] shared by every head
for MLA. One block of one layer's keys (or latents) is one contiguous run of bytes, and so is a
run of consecutive blocks. Disaggregated prefill
registers the buffer with the transfer engine once and writes a peer's blocks at their offsets
(`inference.disagg.layout.KVRegion.offset`).
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
    """The whole cache: [layers, kinds, num_blocks, block_size, heads, dim], zeroed."""
    shape = (config.num_layers, *config.kv_cache_shape[:1], num_blocks, block_size)
    shape += config.kv_cache_shape[1:]
    return torch.zeros(shape, dtype=dtype, device=device)


def layer_caches(buffer: torch.Tensor) -> list:
    """Per layer, contiguous views of `buffer`: the key and the value cache, each
    [num_blocks, block_size, kv_heads, head_dim], or for MLA (one kind, one head) the latent
    cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]."""
    if buffer.shape[1] == 1:
        return [buffer[layer, 0, :, :, 0] for layer in range(buffer.shape[0])]
    return [(buffer[layer, 0], buffer[layer, 1]) for layer in range(buffer.shape[0])]

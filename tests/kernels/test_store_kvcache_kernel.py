"""The Triton KV-cache store: each new token's keys and values land in the slot the mapping
names, slot −1 is skipped, and nothing else in the cache changes."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import store_kvcache_triton
from tests.kernels.kernel_checks import poisoned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 64), (3, 24), (8, 80)])
def test_it_writes_only_the_mapped_slots(dtype, block_size, kv_heads, head_dim):
    num_blocks, tokens, heads = 7, 11, 2 * kv_heads
    k_cache = poisoned((num_blocks, block_size, kv_heads, head_dim), dtype)
    v_cache = poisoned((num_blocks, block_size, kv_heads, head_dim), dtype)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[torch.randperm(tokens)[:3]] = -1  # padding tokens of the step
    # key and value as the engine has them: views into the fused q|k|v projection.
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, dtype=dtype)
    _, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    key = key.view(tokens, kv_heads, head_dim)
    value = value.view(tokens, kv_heads, head_dim)

    store_kvcache_triton(key, value, k_cache, v_cache, slots)

    k_flat = k_cache.view(-1, kv_heads, head_dim)
    v_flat = v_cache.view(-1, kv_heads, head_dim)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:  # a copy: exact
            assert torch.equal(k_flat[slot], key[row]) and torch.equal(v_flat[slot], value[row])
    written = {slot for slot in slots.tolist() if slot >= 0}
    untouched = [slot for slot in range(k_flat.shape[0]) if slot not in written]
    assert torch.isnan(k_flat[untouched]).all() and torch.isnan(v_flat[untouched]).all()


def test_an_empty_step_writes_nothing():
    k_cache, v_cache = (
        poisoned((2, 16, 1, 8), torch.float32),
        poisoned((2, 16, 1, 8), torch.float32),
    )
    empty = torch.empty(0, 1, 8)
    store_kvcache_triton(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.long))
    assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all()

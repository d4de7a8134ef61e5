"""Extend (prefill) attention: the one-launch Triton kernel and its PyTorch reference against
float64 math written out independently (dense per-sequence K/V, an explicit causal mask), on fresh
random inputs each run, over packed ragged sequences with paged, shuffled, -1-padded prefixes."""

from __future__ import annotations

import os

import pytest
import torch

# The interpreter must be chosen before the module holding the @triton.jit functions is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.extend_attention import extend_attention_torch, extend_attention_triton
from tests.kernels.kernel_checks import check_attention

# Written into every cache slot that holds no prefix token, including the slots of this step's
# new tokens: a kernel that reads new tokens back from the cache is far off.
POISON = 1e3

# (num_heads, num_kv_heads, head_dim, block_size, [(prefix_len, new_tokens), ...]): prefixes of
# zero, block-aligned and not; single new tokens; runs of new tokens longer than a 128-row tile.
CASES = [
    pytest.param(2, 2, 64, 16, [(0, 17), (16, 1), (33, 40)], id="mha-d64-page16"),
    pytest.param(6, 2, 80, 32, [(45, 130), (0, 5), (64, 33)], id="gqa3-d80-page32"),
    pytest.param(8, 1, 40, 16, [(100, 20), (7, 150), (0, 1)], id="mqa8-d40-page16"),
]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
]


def make_batch(num_heads, num_kv_heads, head_dim, block_size, sequences, dtype):
    """Packed new tokens, dense per-sequence K/V (prefix then new), and a paged cache.

    The cache holds each sequence's prefix in blocks drawn from a random permutation
    (non-contiguous, non-monotonic); the blocks also cover the new tokens' positions, as the
    engine allocates them, but those slots are poisoned. Three blocks belong to no sequence and
    block-table entries past a sequence's blocks are -1 (two spare columns for all).
    """
    pages = [-(-(prefix + new) // block_size) for prefix, new in sequences]
    num_blocks = sum(pages) + 3
    block_ids = torch.randperm(num_blocks, dtype=torch.int32)
    block_tables = torch.full((len(sequences), max(pages) + 2), -1, dtype=torch.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, POISON, dtype=dtype)
    v_cache = torch.full(cache_shape, POISON, dtype=dtype)
    keys, values = [], []
    used = 0
    for row, ((prefix_len, new_tokens), num_pages) in enumerate(zip(sequences, pages, strict=True)):
        ids = block_ids[used : used + num_pages]
        used += num_pages
        block_tables[row, :num_pages] = ids
        slots = (ids.long()[:, None] * block_size + torch.arange(block_size)).flatten()
        keys.append(torch.randn(prefix_len + new_tokens, num_kv_heads, head_dim).to(dtype))
        values.append(torch.randn(prefix_len + new_tokens, num_kv_heads, head_dim).to(dtype))
        k_cache.view(-1, num_kv_heads, head_dim)[slots[:prefix_len]] = keys[-1][:prefix_len]
        v_cache.view(-1, num_kv_heads, head_dim)[slots[:prefix_len]] = values[-1][:prefix_len]
    key = torch.cat([k[prefix:] for k, (prefix, _) in zip(keys, sequences, strict=True)])
    value = torch.cat([v[prefix:] for v, (prefix, _) in zip(values, sequences, strict=True)])
    query = torch.randn(key.shape[0], num_heads, head_dim).to(dtype)
    new_tokens = torch.tensor([0] + [new for _, new in sequences])
    query_start_loc = new_tokens.cumsum(0).to(torch.int32)
    prefix_lens = torch.tensor([prefix for prefix, _ in sequences], dtype=torch.int32)
    kernel_args = (query, key, value, k_cache, v_cache, block_tables, query_start_loc, prefix_lens)
    return kernel_args, keys, values


def expected_float64(query, keys, values, sequences, scale):
    """Per sequence, float64 softmax attention of its new rows over [prefix, new] with new row i
    seeing keys up to prefix + i; KV heads repeated for their query heads."""
    group = query.shape[1] // keys[0].shape[1]
    rows = []
    start = 0
    for k, v, (prefix_len, new_tokens) in zip(keys, values, sequences, strict=True):
        q = query[start : start + new_tokens].double()
        start += new_tokens
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,lhd->hql", q, k) * scale
        visible = torch.ones(new_tokens, prefix_len + new_tokens).tril(diagonal=prefix_len).bool()
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        rows.append(torch.einsum("hql,lhd->qhd", weights, v))
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,sequences", CASES)
def test_triton_matches_float64(num_heads, num_kv_heads, head_dim, block_size, sequences, dtype):
    shape_id = f"Hq={num_heads} Hk={num_kv_heads} D={head_dim} page={block_size} {sequences}"
    kernel_args, keys, values = make_batch(
        num_heads, num_kv_heads, head_dim, block_size, sequences, dtype
    )
    query = kernel_args[0]
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))  # any element the kernel does not write fails
    assert extend_attention_triton(*kernel_args, scale, out=out) is out
    check_attention(
        out, expected_float64(query, keys, values, sequences, scale), dtype, shape_id
    )  # ATTENTION_TOLERANCE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,sequences", CASES)
def test_reference_matches_float64(num_heads, num_kv_heads, head_dim, block_size, sequences, dtype):
    shape_id = f"Hq={num_heads} Hk={num_kv_heads} D={head_dim} page={block_size} {sequences}"
    kernel_args, keys, values = make_batch(
        num_heads, num_kv_heads, head_dim, block_size, sequences, dtype
    )
    query = kernel_args[0]
    scale = head_dim**-0.5
    out = extend_attention_torch(*kernel_args, scale)
    assert out.dtype == dtype
    check_attention(
        out, expected_float64(query, keys, values, sequences, scale), dtype, shape_id
    )  # ATTENTION_TOLERANCE


def test_triton_in_float16_and_without_an_out_buffer():
    sequences = [(20, 70), (0, 33)]
    kernel_args, keys, values = make_batch(9, 3, 96, 32, sequences, torch.float16)
    query = kernel_args[0]
    scale = 96**-0.5
    out = extend_attention_triton(*kernel_args, scale)
    assert out.dtype == torch.float16 and out.shape == query.shape
    expected = expected_float64(query, keys, values, sequences, scale)
    check_attention(
        out, expected, torch.float16, f"Hq=9 Hk=3 D=96 page=32 {sequences} fp16"
    )  # 1e-4/1e-3
    check_attention(
        extend_attention_torch(*kernel_args, scale), expected, torch.float16, "reference"
    )

"""Decode attention: the split-KV Triton kernel and its PyTorch reference against float64 math
written out independently (dense per-sequence K/V, no block tables), on fresh random inputs each
run, over ragged batches stored in shuffled, -1-padded paged caches."""

from __future__ import annotations

import os

import pytest
import torch

# The interpreter must be chosen before the module holding the @triton.jit functions is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import decode_attention
from kernels.decode_attention import decode_attention_torch, decode_attention_triton
from tests.kernels.kernel_checks import check_attention

# Written into cache slots outside every context: a kernel that attends to them is far off.
POISON = 1e3

# (num_heads, num_kv_heads, head_dim, block_size, context_lens); lengths include a block
# multiple and one past it, a single token, and lengths spanning several 64-token tiles.
CASES = [
    pytest.param(4, 4, 64, 16, [1, 16, 17, 300], id="mha-d64-page16"),
    pytest.param(6, 2, 80, 32, [64, 65, 200, 7], id="gqa3-d80-page32"),
    pytest.param(16, 2, 40, 16, [300, 1, 33, 128, 95], id="gqa8-d40-page16"),
    pytest.param(8, 1, 96, 32, [257, 31], id="mqa8-d96-page32"),
]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
]


def make_batch(num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype):
    """Random query and per-sequence K/V, and the same K/V scattered into a paged cache.

    Each sequence's blocks are drawn from a random permutation of the cache (non-contiguous,
    non-monotonic), three blocks belong to no sequence, and block-table entries past a sequence's
    blocks are -1 (two spare columns for all).
    """
    pages = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(pages) + 3
    block_ids = torch.randperm(num_blocks, dtype=torch.int32)
    block_tables = torch.full((len(context_lens), max(pages) + 2), -1, dtype=torch.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, POISON, dtype=dtype)
    v_cache = torch.full(cache_shape, POISON, dtype=dtype)
    keys, values = [], []
    used = 0
    for row, (context_len, num_pages) in enumerate(zip(context_lens, pages, strict=True)):
        ids = block_ids[used : used + num_pages]
        used += num_pages
        block_tables[row, :num_pages] = ids
        slots = (ids.long()[:, None] * block_size + torch.arange(block_size)).flatten()
        slots = slots[:context_len]
        keys.append(torch.randn(context_len, num_kv_heads, head_dim).to(dtype))
        values.append(torch.randn(context_len, num_kv_heads, head_dim).to(dtype))
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = keys[-1]
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = values[-1]
    query = torch.randn(len(context_lens), num_heads, head_dim).to(dtype)
    context_lens = torch.tensor(context_lens, dtype=torch.int32)
    return query, keys, values, (k_cache, v_cache, block_tables, context_lens)


def expected_float64(query, keys, values, scale):
    """softmax(q·kᵀ·scale)·v per sequence in float64, KV heads repeated for their query heads."""
    group = query.shape[1] // keys[0].shape[1]
    rows = []
    for q, k, v in zip(query.double(), keys, values, strict=True):
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q, k) * scale, dim=-1)
        rows.append(torch.einsum("hl,lhd->hd", weights, v))
    return torch.stack(rows)


def run_triton_with_poisoned_out(query, cache_args, scale):
    out = torch.full_like(query, float("nan"))  # any element the kernel does not write fails
    result = decode_attention_triton(query, *cache_args, scale, out=out)
    assert result is out
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,context_lens", CASES)
def test_triton_matches_float64(num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype):
    shape_id = f"Hq={num_heads} Hk={num_kv_heads} D={head_dim} page={block_size} {context_lens}"
    query, keys, values, cache_args = make_batch(
        num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype
    )
    scale = head_dim**-0.5
    out = run_triton_with_poisoned_out(query, cache_args, scale)
    assert out.dtype == dtype
    check_attention(
        out, expected_float64(query, keys, values, scale), dtype, shape_id
    )  # ATTENTION_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,context_lens", CASES)
def test_reference_matches_float64(
    num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype
):
    shape_id = f"Hq={num_heads} Hk={num_kv_heads} D={head_dim} page={block_size} {context_lens}"
    query, keys, values, cache_args = make_batch(
        num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype
    )
    scale = head_dim**-0.5
    out = decode_attention_torch(query, *cache_args, scale)
    assert out.dtype == dtype
    check_attention(
        out, expected_float64(query, keys, values, scale), dtype, shape_id
    )  # ATTENTION_TOLERANCE[dtype]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,context_lens",
    [
        pytest.param(6, 2, 80, 16, [8200, 1, 129], id="gqa3-d80-page16"),
        pytest.param(8, 1, 64, 32, [150, 8200], id="mqa8-d64-page32"),
    ],
)
def test_triton_when_one_program_walks_many_tiles(
    num_heads, num_kv_heads, head_dim, block_size, context_lens
):
    # A program walks its split tile by tile, rescaling its online softmax at each tile. Small
    # batches of short contexts get a tile per split (the plan fills the GPU with programs), so
    # a long context here takes the plan past its 64 splits, to several tiles each; the short
    # context beside it is one program's whole walk, as for a large batch (one split each).
    shape_id = f"Hq={num_heads} Hk={num_kv_heads} D={head_dim} page={block_size} {context_lens}"
    query, keys, values, cache_args = make_batch(
        num_heads, num_kv_heads, head_dim, block_size, context_lens, torch.float32
    )
    block_tables = cache_args[2]
    _, split_len = decode_attention._split_plan(
        len(context_lens), num_kv_heads, block_tables.shape[1] * block_size, query.device
    )
    assert split_len >= 3 * 64, shape_id  # 64-token tiles
    assert any(2 * 64 < n <= split_len for n in context_lens), shape_id  # a whole walk
    scale = head_dim**-0.5
    out = run_triton_with_poisoned_out(query, cache_args, scale)
    check_attention(
        out, expected_float64(query, keys, values, scale), torch.float32, shape_id
    )  # 2e-5


def test_triton_in_float16_and_without_an_out_buffer():
    query, keys, values, cache_args = make_batch(12, 4, 72, 16, [33, 160, 48], torch.float16)
    scale = 72**-0.5
    out = decode_attention_triton(query, *cache_args, scale)
    assert out.dtype == torch.float16 and out.shape == query.shape
    expected = expected_float64(query, keys, values, scale)
    check_attention(out, expected, torch.float16, "Hq=12 Hk=4 D=72 page=16 fp16")  # (1e-4, 1e-3)
    check_attention(
        decode_attention_torch(query, *cache_args, scale), expected, torch.float16, "reference"
    )


def test_split_plan_fills_the_gpu_within_the_context():
    cpu = torch.device("cpu")  # planned as for an H200's 132 SMs
    # Few sequences: as many splits as 64-token tiles, at most 64.
    assert decode_attention._split_plan(2, 2, 300, cpu) == (5, 64)
    assert decode_attention._split_plan(1, 1, 32768, cpu) == (64, 512)
    # The benchmark's 64 sequences x 8 KV heads: several programs per SM.
    for max_context in [1024, 32768]:
        num_splits, split_len = decode_attention._split_plan(64, 8, max_context, cpu)
        assert 64 * 8 * num_splits >= 4 * 132, (max_context, num_splits)
    for batch, num_kv_heads, max_context in [(64, 8, 32768), (64, 8, 1000), (3, 1, 1000)]:
        num_splits, split_len = decode_attention._split_plan(batch, num_kv_heads, max_context, cpu)
        shape = f"B={batch} Hk={num_kv_heads} context={max_context}: {num_splits}x{split_len}"
        assert split_len % 64 == 0, shape  # whole tiles
        # The splits cover the context, and none is planned empty.
        assert (num_splits - 1) * split_len < max_context <= num_splits * split_len, shape

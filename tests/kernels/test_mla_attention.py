"""Multi-head Latent Attention: the latent-cache store, the absorbed split-KV decode and the
decompressed prefill, Triton kernels and PyTorch references alike, against float64 math written
out independently (dense per-sequence tensors, no block tables), on fresh random inputs each run,
over ragged batches stored in shuffled paged caches poisoned outside every context."""

from __future__ import annotations

import os

import pytest
import torch

# The interpreter must be chosen before the module holding the @triton.jit functions is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import mla_attention
from kernels.attention import build_paged_attention_batch
from kernels.mla_attention import (
    mla_decode_torch,
    mla_decode_triton,
    mla_prefill_torch,
    mla_prefill_triton,
    store_latent_torch,
    store_latent_triton,
)
from tests.kernels.kernel_checks import TOLERANCE, check_attention, poisoned

# Written into cache slots outside every context: a kernel that attends to them is far off.
POISON = 1e3

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
]


def check(actual, expected, dtype, shape_id, implementation) -> None:
    """The Triton kernels accumulate in float32 and round once, at ATTENTION_TOLERANCE. CPU
    SDPA in bf16 also rounds its probabilities to bf16 before P @ V (about 4e-3 relative seen),
    so the references get the bf16 tolerance of every reference op, TOLERANCE (2e-2)."""
    assert actual.dtype == dtype
    if implementation == "triton" or dtype == torch.float32:
        check_attention(actual, expected, dtype, shape_id)  # ATTENTION_TOLERANCE[dtype]
    else:
        atol, rtol = TOLERANCE[dtype]
        torch.testing.assert_close(
            actual.double(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{shape_id}: {m}"
        )


# ---------------------------------------------------------------------------------- store


@pytest.mark.parametrize(
    "store", [store_latent_torch, store_latent_triton], ids=["torch", "triton"]
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "latent_dim,rope_dim,block_size", [(32, 8, 16), (48, 12, 32), (512, 64, 16)]
)
def test_store_latent_writes_only_the_mapped_slots(store, dtype, latent_dim, rope_dim, block_size):
    num_blocks, tokens, row = 5, 13, latent_dim + rope_dim
    cache = poisoned((num_blocks, block_size, row), dtype)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[torch.randperm(tokens)[:3]] = -1  # padding tokens of the step
    # latent and rope key as the model has them: views into one projection's output rows, after
    # other columns (the query's compressed part in DeepSeek-V3's fused q_a | kv_a projection).
    projection = torch.randn(tokens, 24 + row).to(dtype)
    latent, rope_key = projection[:, 24:].split([latent_dim, rope_dim], dim=-1)

    store(latent, rope_key, cache, slots)

    rows = cache.view(-1, row)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:  # a copy: exact
            assert torch.equal(rows[slot], projection[token, 24:]), (token, slot)
    written = {slot for slot in slots.tolist() if slot >= 0}
    untouched = [slot for slot in range(rows.shape[0]) if slot not in written]
    assert torch.isnan(rows[untouched]).all()


@pytest.mark.parametrize(
    "store", [store_latent_torch, store_latent_triton], ids=["torch", "triton"]
)
def test_store_latent_of_an_empty_step_writes_nothing(store):
    cache = poisoned((2, 16, 40), torch.float32)
    store(torch.empty(0, 32), torch.empty(0, 8), cache, torch.empty(0, dtype=torch.long))
    assert torch.isnan(cache).all()


# --------------------------------------------------------------------------------- decode


def mla_reference_float64(q_latent, q_rope, latents, rope_keys, scale):
    """Absorbed MLA per sequence in float64: softmax(scale·(q_latent·cᵀ + q_rope·krᵀ)) · c."""
    rows = []
    for ql, qr, c, kr in zip(q_latent.double(), q_rope.double(), latents, rope_keys, strict=True):
        c, kr = c.double(), kr.double()
        weights = torch.softmax((ql @ c.T + qr @ kr.T) * scale, dim=-1)
        rows.append(weights @ c)
    return torch.stack(rows)


def make_decode_batch(num_heads, latent_dim, rope_dim, block_size, context_lens, dtype):
    """Random queries and per-sequence latent rows, the rows scattered into a paged cache.

    Each sequence's blocks are drawn from a random permutation of the cache (non-contiguous,
    non-monotonic) and three blocks belong to no sequence. The batch also holds a prefill after
    the decodes (its blocks poisoned): the decode reads only the first `num_decode` sequences,
    and its block table is wider than any of theirs.
    """
    prefill_context = max(context_lens) + 40
    all_contexts = [*context_lens, prefill_context]
    pages = [-(-n // block_size) for n in all_contexts]
    block_ids = torch.randperm(sum(pages) + 3).tolist()
    cache = torch.full((len(block_ids), block_size, latent_dim + rope_dim), POISON, dtype=dtype)
    block_tables, latents, rope_keys = [], [], []
    for context_len, num_pages in zip(all_contexts, pages, strict=True):
        block_tables.append([block_ids.pop() for _ in range(num_pages)])
        ids = torch.tensor(block_tables[-1])
        slots = (ids[:, None] * block_size + torch.arange(block_size)).flatten()[:context_len]
        if len(latents) < len(context_lens):
            latents.append(torch.randn(context_len, latent_dim).to(dtype))
            rope_keys.append(torch.randn(context_len, rope_dim).to(dtype))
            cache.view(-1, latent_dim + rope_dim)[slots] = torch.cat(
                [latents[-1], rope_keys[-1]], dim=-1
            )
    query_lens = [1] * len(context_lens) + [3]
    batch = build_paged_attention_batch(block_tables, query_lens, all_contexts, block_size)
    assert batch.num_decode == len(context_lens)
    q_latent = torch.randn(len(context_lens), num_heads, latent_dim).to(dtype)
    q_rope = torch.randn(len(context_lens), num_heads, rope_dim).to(dtype)
    return (q_latent, q_rope, cache, batch), latents, rope_keys


# (num_heads, kv_lora_rank R, qk_rope_head_dim P, block_size, context_lens); lengths include a
# single token, a block multiple and one past it, and lengths spanning several 32-token splits.
DECODE_CASES = [
    pytest.param(4, 32, 8, 16, [1, 16, 17, 300], id="h4-r32-p8-page16"),
    pytest.param(6, 48, 16, 32, [64, 65, 200, 7], id="h6-r48-p16-page32"),
    pytest.param(20, 40, 12, 16, [33, 96, 1], id="h20-r40-p12-page16"),  # two head blocks
    pytest.param(16, 512, 64, 16, [1, 33, 80], id="deepseek-h16-r512-p64-page16"),
]
DECODE_IMPLEMENTATIONS = [
    pytest.param(mla_decode_torch, "torch", id="torch"),
    pytest.param(mla_decode_triton, "triton", id="triton"),
]


@pytest.mark.parametrize("decode,implementation", DECODE_IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,latent_dim,rope_dim,block_size,context_lens", DECODE_CASES)
def test_mla_decode_matches_float64(
    decode, implementation, num_heads, latent_dim, rope_dim, block_size, context_lens, dtype
):
    shape_id = f"H={num_heads} R={latent_dim} P={rope_dim} page={block_size} {context_lens}"
    args, latents, rope_keys = make_decode_batch(
        num_heads, latent_dim, rope_dim, block_size, context_lens, dtype
    )
    q_latent, q_rope = args[:2]
    scale = (128 + rope_dim) ** -0.5  # DeepSeek's softmax scale is over the decompressed dim
    out = torch.full_like(q_latent, float("nan"))  # any element the kernel does not write fails
    assert decode(*args, scale, out=out) is out
    expected = mla_reference_float64(q_latent, q_rope, latents, rope_keys, scale)
    check(out, expected, dtype, shape_id, implementation)


def test_mla_decode_triton_when_one_program_walks_many_tiles():
    # Short contexts give a tile per split (the plan fills the GPU with programs); a context past
    # 64 splits of 32 tokens makes each program rescale its online softmax over several tiles.
    context_lens = [4200, 1, 150]
    shape_id = f"H=4 R=32 P=8 page=16 {context_lens}"
    args, latents, rope_keys = make_decode_batch(4, 32, 8, 16, context_lens, torch.float32)
    block_tables = args[3].kernel_batch().block_tables
    _, split_len = mla_attention._mla_split_plan(
        3, 1, block_tables.shape[1] * 16, torch.device("cpu")
    )
    assert split_len >= 3 * 32, shape_id
    scale = 40**-0.5
    out = mla_decode_triton(*args, scale)
    expected = mla_reference_float64(args[0], args[1], latents, rope_keys, scale)
    check_attention(out, expected, torch.float32, shape_id)  # 2e-5


def test_mla_split_plan_covers_the_context_in_whole_tiles():
    cpu = torch.device("cpu")  # planned as for an H200's 132 SMs
    assert mla_attention._mla_split_plan(2, 1, 300, cpu) == (10, 32)  # a split per tile
    for num_seqs, head_blocks, max_context in [(64, 8, 32768), (64, 1, 1000), (3, 1, 1000)]:
        num_splits, split_len = mla_attention._mla_split_plan(
            num_seqs, head_blocks, max_context, cpu
        )
        shape = f"N={num_seqs} head_blocks={head_blocks} context={max_context}"
        assert split_len % 32 == 0, shape
        assert (num_splits - 1) * split_len < max_context <= num_splits * split_len, shape
        assert num_splits <= 64, shape


# -------------------------------------------------------------------------------- prefill


def expected_prefill_float64(query, keys, values, segments, scale):
    """Per segment, float64 attention of its queries, the last q_len of its k_len positions,
    with query i seeing keys j <= k_len - q_len + i."""
    rows = []
    start = 0
    for k, v, (prefix_len, query_len) in zip(keys, values, segments, strict=True):
        q = query[start : start + query_len].double()
        start += query_len
        scores = torch.einsum("qhd,khd->hqk", q, k.double()) * scale
        visible = torch.ones(query_len, prefix_len + query_len).tril(diagonal=prefix_len).bool()
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        rows.append(torch.einsum("hqk,khd->qhd", weights, v.double()))
    return torch.cat(rows)


def make_prefill(num_heads, qk_dim, v_dim, segments, dtype):
    """Packed queries and keys/values of the segments [(prefix_len, query_len), ...]; key and
    value are strided views of one decompression output, as the model splits it."""
    key_lens = [prefix + new for prefix, new in segments]
    decompressed = torch.randn(sum(key_lens), num_heads, qk_dim + v_dim).to(dtype)
    key, value = decompressed.split([qk_dim, v_dim], dim=-1)
    query = torch.randn(sum(new for _, new in segments), num_heads, qk_dim).to(dtype)
    query_start_loc = torch.tensor([0] + [new for _, new in segments]).cumsum(0).to(torch.int32)
    key_start_loc = torch.tensor([0, *key_lens]).cumsum(0).to(torch.int32)
    keys = list(key.split(key_lens))
    values = list(value.split(key_lens))
    return (query, key, value, query_start_loc, key_start_loc), keys, values


# (num_heads, Dqk, Dv, [(prefix_len, query_len), ...]): segments without a prefix
# (q_len == k_len), with one, single tokens, and runs longer than a 64- or 128-row query tile.
PREFILL_CASES = [
    pytest.param(2, 24, 16, [(0, 17), (16, 1), (33, 40)], id="h2-qk24-v16"),
    pytest.param(3, 192, 128, [(0, 70), (0, 1), (40, 130)], id="h3-qk192-v128"),
    pytest.param(4, 80, 80, [(5, 3), (64, 64), (1, 1)], id="h4-qk80-v80"),
]
PREFILL_IMPLEMENTATIONS = [
    pytest.param(mla_prefill_torch, "torch", id="torch"),
    pytest.param(mla_prefill_triton, "triton", id="triton"),
]


@pytest.mark.parametrize("prefill,implementation", PREFILL_IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,qk_dim,v_dim,segments", PREFILL_CASES)
def test_mla_prefill_matches_float64(
    prefill, implementation, num_heads, qk_dim, v_dim, segments, dtype
):
    shape_id = f"H={num_heads} Dqk={qk_dim} Dv={v_dim} {segments}"
    args, keys, values = make_prefill(num_heads, qk_dim, v_dim, segments, dtype)
    query = args[0]
    scale = qk_dim**-0.5
    out = poisoned((query.shape[0], num_heads, v_dim), dtype)
    assert prefill(*args, scale, out=out) is out
    expected = expected_prefill_float64(query, keys, values, segments, scale)
    check(out, expected, dtype, shape_id, implementation)


@pytest.mark.parametrize(
    "prefill", [mla_prefill_torch, mla_prefill_triton], ids=["torch", "triton"]
)
def test_mla_prefill_without_an_out_buffer(prefill):
    segments = [(7, 20)]
    args, keys, values = make_prefill(2, 40, 24, segments, torch.float32)
    out = prefill(*args, 40**-0.5)
    assert out.shape == (20, 2, 24) and out.dtype == torch.float32
    expected = expected_prefill_float64(args[0], keys, values, segments, 40**-0.5)
    check_attention(out, expected, torch.float32, f"H=2 Dqk=40 Dv=24 {segments}")  # 2e-5


@pytest.mark.parametrize(
    "dim,parts", [(192, (128, 64)), (128, (128, 0)), (24, (16, 16)), (8, (16, 0))]
)
def test_the_query_key_dim_is_read_in_two_power_of_two_parts(dim, parts):
    # 192 = 128 + 64: DeepSeek-V3's head is read without padding it to 256.
    assert mla_attention._split_head_dim(dim) == parts

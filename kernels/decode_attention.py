"""Decode attention over a paged KV cache: one new query token per sequence.

Each sequence's single query token attends to its whole cached context (the new token's own K/V
is already in the cache at position `context_len - 1`), read page by page through its block table
from `k_cache`/`v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim].

Decode is bound by memory bandwidth: every cached K/V byte is read once per step and used for a
handful of multiply-adds. The Triton kernel is shaped around that:

- Split-KV (flash-decoding, `split_kv`). A batch of a few sequences gives too few (batch, head)
  programs to occupy a GPU, so stage 1 also splits each context into `num_splits` contiguous
  ranges, one program each, over a grid (batch, kv_head, split). Every program keeps an online
  softmax over its range and writes a partial output (normalised by its own softmax sum) and the
  range's log-sum-exp. Stage 2, grid (batch, q_head), merges the splits: weighting each partial
  by exp(lse_split - lse_total) gives exactly the softmax over the whole context.
  Splits that start past a short sequence's end write nothing and are skipped by the merge.
- K/V read once per GQA group. One stage-1 program serves all the query heads that share a KV
  head: their queries form the rows of one small matrix (padded to 16 rows so `tl.dot` is legal
  on tensor cores), so each K/V tile is loaded once per group instead of once per query head;
  with 32 query heads over 8 KV heads that is 4x less cache traffic.
- Tiles of `_BLOCK_N` tokens span several pages: each token's address is looked up through the
  block table, so the page size (16, 32, ...) needs no special casing and loads stay wide.

Arithmetic is float32 on the CPU interpreter (which computes bf16 wrongly) and for float32
inputs; on CUDA, bf16/fp16 K/V feed `tl.dot` directly with float32 accumulation.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.split_kv import empty_partials, merge_splits, split_plan, store_partial

# Tokens per stage-1 iteration: 4 pages of 16, enough bytes in flight per load on a GPU.
_BLOCK_N = 64
# Query-head rows per program are padded to this, the smallest M of a tensor-core `tl.dot`.
_MIN_HEAD_ROWS = 16


def decode_attention_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged cached context (reference).

    query [B, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hk, D]; block_tables int32
    [B, max_blocks]; context_lens int32 [B] (the new token is the last cached position).
    Query head h reads KV head h // (Hq // Hk). Computes in float32 (float64 for float64 inputs)
    and returns [B, Hq, D] in query's dtype, written into `out` when given.
    """
    _, num_heads, head_dim = query.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    if out is None:
        out = torch.empty_like(query)
    for row, context_len in enumerate(context_lens.tolist()):
        pages = block_tables[row, : -(-context_len // page_size)].long()
        keys = k_cache[pages].flatten(0, 1)[:context_len].to(compute_dtype)
        values = v_cache[pages].flatten(0, 1)[:context_len].to(compute_dtype)
        q = query[row].to(compute_dtype).view(num_kv_heads, group, head_dim)
        scores = torch.einsum("kgd,lkd->kgl", q, keys) * scale
        attended = torch.einsum("kgl,lkd->kgd", scores.softmax(-1), values)
        out[row] = attended.reshape(num_heads, head_dim).to(out.dtype)
    return out


@triton.jit
def _decode_split_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    num_heads,
    num_splits,
    split_len,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    split_start = split * split_len
    if split_start >= context_len:
        return
    split_end = tl.minimum(split_start + split_len, context_len)

    dot_dtype = tl.float32 if COMPUTE_FP32 else k_cache_ptr.dtype.element_ty

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    head_mask = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    seq64 = seq.to(tl.int64)

    q = tl.load(
        query_ptr + seq64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=head_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(dot_dtype)

    block_table_row = block_tables_ptr + seq64 * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(split_start, split_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < split_end
        # Masked so block-table entries past the context (arbitrary, may be -1) are never read.
        pages = tl.load(block_table_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = offs_n % PAGE_SIZE
        k_rows = pages * stride_kb + in_page * stride_kt + kv_head * stride_kh
        v_rows = pages * stride_vb + in_page * stride_vt + kv_head * stride_vh
        kv_mask = n_mask[None, :] & d_mask[:, None]
        # K is loaded already transposed, [D, N], as the right operand of q @ K^T.
        k = tl.load(k_cache_ptr + k_rows[None, :] + offs_d[:, None], mask=kv_mask, other=0.0)
        scores = tl.dot(q, k.to(dot_dtype), input_precision="ieee") * scale_log2
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        # `online_softmax.fold_scores` written out, so that V is loaded only after the weights:
        # loaded before them, its tile costs shared memory beside K's (36 KiB, not 22, on sm_90)
        # or more spilled registers.
        # Every tile holds at least one valid token, so m_new is finite and nothing is NaN.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + v_rows[:, None] + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(
            p.to(dot_dtype), v.to(dot_dtype), input_precision="ieee"
        )
        m_i = m_new

    store_partial(
        partial_out_ptr,
        partial_lse_ptr,
        acc,
        m_i,
        l_i,
        seq64,
        heads,
        head_mask,
        split,
        num_heads,
        num_splits,
        offs_d,
        d_mask,
        HEAD_DIM,
    )


def _split_plan(
    batch: int, num_kv_heads: int, max_context: int, device: torch.device
) -> tuple[int, int]:
    """(num_splits, split_len) of stage 1, whose programs each serve one KV head."""
    return split_plan(batch * num_kv_heads, max_context, _BLOCK_N, device)


def decode_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split-KV (flash-decoding) Triton kernel; same contract as `decode_attention_torch`.

    The number of splits is planned from the block table's width (an upper bound on the longest
    context known on the host), so no value is read back from the GPU and the launch can be
    captured in a CUDA graph.
    """
    batch, num_heads, head_dim = query.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches must be contiguous in D"
    assert out.stride(-1) == 1, "out must be contiguous in its last dimension"
    assert block_tables.stride(-1) == 1 and context_lens.stride(-1) == 1

    num_splits, split_len = _split_plan(
        batch, num_kv_heads, block_tables.shape[1] * page_size, query.device
    )
    partial_out, partial_lse = empty_partials(batch, num_heads, num_splits, head_dim, query.device)
    compute_fp32 = not query.is_cuda or query.dtype == torch.float32

    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        partial_out,
        partial_lse,
        scale * math.log2(math.e),
        num_heads,
        num_splits,
        split_len,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        GROUP=group,
        PAGE_SIZE=page_size,
        BLOCK_H=max(_MIN_HEAD_ROWS, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=_BLOCK_N,
        COMPUTE_FP32=compute_fp32,
        num_warps=4,
        num_stages=2,
    )
    # A [splits, D] float32 tile fits in registers: every split's row is summed at once.
    merge_splits(partial_out, partial_lse, context_lens, split_len, out, num_splits)
    return out

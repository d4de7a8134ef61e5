"""Extend (prefill) attention: new tokens over a paged cached prefix plus themselves, causally.

One step packs the new tokens of B sequences back to back ([T, H, D], sequence b at rows
`query_start_loc[b]:query_start_loc[b+1]`). New token i of sequence b sits at position
`prefix_lens[b] + i` and attends to the cached prefix (positions [0, prefix_lens[b]), read
through the block table from `k_cache`/`v_cache` [num_blocks, block_size, Hk, D]) and to the new
tokens j <= i, read from this step's `key`/`value`. The new tokens are never read back from the
cache, so the kernel does not depend on them having been written there first. This covers plain
prefill (prefix 0), chunked prefill and prefill after a prefix-cache hit.

Prefill is bound by matrix-multiply throughput, so the Triton kernel is a FlashAttention-2 forward
pass adapted to the packed, paged layout, in ONE launch for all sequences:

- Grid (query tiles, sequence, query head). Tiles past a sequence's length exit at once. Tiles
  are issued last-first: the latest rows have the most keys, so starting them early shortens the
  tail of the launch.
- Its loops share one online softmax (running max, sum and float32 accumulator, `exp2` with
  log2(e) folded into the scale): the prefix through the block table (every new token sees all
  of it, so only its ragged last tile is masked); the new tokens before the tile, unmasked; and
  the tile's own diagonal block with the causal mask. Nothing above the diagonal is computed,
  and no score tile outside the prefix's end and the diagonal pays for a mask.
- Each key tile spans `BLOCK_N` tokens across pages, each token's address looked up through the
  block table, so page sizes 16, 32, ... need no special casing.

Arithmetic is float32 on the CPU interpreter (which computes bf16 wrongly) and for float32
inputs; on CUDA, bf16/fp16 Q/K/V feed `tl.dot` directly with float32 accumulation.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.online_softmax import fold_key_tile


def extend_attention_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their paged prefix and themselves (reference).

    query [T, Hq, D] and key/value [T, Hk, D] hold the new tokens; query_start_loc int32 [B+1]
    delimits the sequences; prefix_lens int32 [B] counts each one's cached tokens, read from
    k_cache/v_cache [num_blocks, block_size, Hk, D] through block_tables int32 [B, max_blocks].
    Query head h reads KV head h // (Hq // Hk). Computes in float32 (float64 for float64 inputs)
    and returns [T, Hq, D] in query's dtype, written into `out` when given.
    """
    _, num_heads, head_dim = query.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for row, prefix_len in enumerate(prefix_lens.tolist()):
        start, end = starts[row], starts[row + 1]
        query_len = end - start
        pages = block_tables[row, : -(-prefix_len // page_size)].long()
        keys = torch.cat([k_cache[pages].flatten(0, 1)[:prefix_len], key[start:end]])
        values = torch.cat([v_cache[pages].flatten(0, 1)[:prefix_len], value[start:end]])
        q = query[start:end].to(compute_dtype).view(query_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qkgd,lkd->kgql", q, keys.to(compute_dtype)) * scale
        key_positions = torch.arange(prefix_len + query_len, device=query.device)
        query_positions = prefix_len + torch.arange(query_len, device=query.device)
        causal = key_positions[None, :] <= query_positions[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        attended = torch.einsum("kgql,lkd->qkgd", scores.softmax(-1), values.to(compute_dtype))
        out[start:end] = attended.reshape(query_len, num_heads, head_dim).to(out.dtype)
    return out


@triton.jit
def _load_prefix_tile(
    k_head_ptr,
    v_head_ptr,
    block_table_row,
    positions,
    n_mask,
    offs_d,
    d_mask,
    stride_kcb,
    stride_kct,
    stride_vcb,
    stride_vct,
    PAGE_SIZE: tl.constexpr,
):
    """K as [D, N] and V as [N, D] of one KV head at cached `positions`, each looked up through
    the block table. Masked lanes read neither the table (entries past the prefix may be -1)
    nor the cache."""
    pages = tl.load(block_table_row + positions // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    in_page = positions % PAGE_SIZE
    k_rows = pages * stride_kcb + in_page * stride_kct
    v_rows = pages * stride_vcb + in_page * stride_vct
    k = tl.load(
        k_head_ptr + k_rows[None, :] + offs_d[:, None],
        mask=n_mask[None, :] & d_mask[:, None],
        other=0.0,
    )
    v = tl.load(
        v_head_ptr + v_rows[:, None] + offs_d[None, :],
        mask=n_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    return k, v


@triton.jit
def _extend_kernel(
    query_ptr,
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    prefix_lens_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_bt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    tile_start = tile * BLOCK_M
    if tile_start >= query_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + seq)
    kv_head = head // GROUP

    dot_dtype = tl.float32 if COMPUTE_FP32 else query_ptr.dtype.element_ty

    offs_m = tile_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < query_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    query_rows = (query_start + offs_m).to(tl.int64)
    q = tl.load(
        query_ptr + query_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(dot_dtype)

    # A row's first tile always holds a key it sees (a prefix token, or new token 0), as the
    # online softmax needs.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # The cached prefix, through the block table: whole tiles unmasked, then the ragged end.
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head_ptr = k_cache_ptr + kv_head * stride_kch
    v_head_ptr = v_cache_ptr + kv_head * stride_vch
    full_prefix_end = prefix_len // BLOCK_N * BLOCK_N
    for start in range(0, full_prefix_end, BLOCK_N):
        positions = start + offs_n
        k, v = _load_prefix_tile(
            k_head_ptr,
            v_head_ptr,
            block_table_row,
            positions,
            positions < prefix_len,
            offs_d,
            d_mask,
            stride_kcb,
            stride_kct,
            stride_vcb,
            stride_vct,
            PAGE_SIZE,
        )
        m_i, l_i, acc = fold_key_tile(q, k, v, None, m_i, l_i, acc, scale_log2, dot_dtype)
    if full_prefix_end < prefix_len:
        positions = full_prefix_end + offs_n
        n_mask = positions < prefix_len
        k, v = _load_prefix_tile(
            k_head_ptr,
            v_head_ptr,
            block_table_row,
            positions,
            n_mask,
            offs_d,
            d_mask,
            stride_kcb,
            stride_kct,
            stride_vcb,
            stride_vct,
            PAGE_SIZE,
        )
        m_i, l_i, acc = fold_key_tile(
            q, k, v, n_mask[None, :], m_i, l_i, acc, scale_log2, dot_dtype
        )

    # New tokens before this tile: every row sees all of them. BLOCK_M is a multiple of
    # BLOCK_N, so these tiles end exactly at tile_start.
    for start in range(0, tile_start, BLOCK_N):
        key_rows = (query_start + start + offs_n).to(tl.int64)
        k = tl.load(
            key_ptr + key_rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            mask=d_mask[:, None],
            other=0.0,
        )
        v = tl.load(
            value_ptr + key_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            mask=d_mask[None, :],
            other=0.0,
        )
        m_i, l_i, acc = fold_key_tile(q, k, v, None, m_i, l_i, acc, scale_log2, dot_dtype)

    # The diagonal block: causal mask, and keys past the sequence's end are outside its rows.
    for start in range(tile_start, tl.minimum(tile_start + BLOCK_M, query_len), BLOCK_N):
        key_index = start + offs_n
        n_mask = key_index < query_len
        key_rows = (query_start + key_index).to(tl.int64)
        k = tl.load(
            key_ptr + key_rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )
        v = tl.load(
            value_ptr + key_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        causal = (key_index[None, :] <= offs_m[:, None]) & n_mask[None, :]
        m_i, l_i, acc = fold_key_tile(q, k, v, causal, m_i, l_i, acc, scale_log2, dot_dtype)

    tl.store(
        out_ptr + query_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def _tile_config(row_bytes: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for rows of `row_bytes` (padded head dim).

    Up to 256 bytes a row (bf16/fp16 with D <= 128) the FlashAttention-2 tiles for Hopper fit:
    Q 32 KiB plus 3 stages of 16 KiB K and V tiles in shared memory. Wider rows (float32, or
    D = 256) halve the tiles so the stages still fit.
    """
    if row_bytes <= 256:
        return 128, 64, 8, 3
    return 64, 32, 4, 2


def extend_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One-launch Triton FlashAttention over prefix pages and new tokens; same contract as
    `extend_attention_torch`.

    Reads the longest query length back to the host (one sync per call) to size the grid.
    """
    _, num_heads, head_dim = query.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = prefix_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if batch == 0 or query.shape[0] == 0:
        return out
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches must be contiguous in D"
    assert out.stride(-1) == 1, "out must be contiguous in its last dimension"
    assert block_tables.stride(-1) == 1

    max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_d = triton.next_power_of_2(head_dim)
    block_m, block_n, num_warps, num_stages = _tile_config(block_d * query.element_size())
    compute_fp32 = not query.is_cuda or query.dtype == torch.float32

    _extend_kernel[(triton.cdiv(max_query_len, block_m), batch, num_heads)](
        query,
        key,
        value,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        prefix_lens,
        out,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        GROUP=num_heads // num_kv_heads,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        COMPUTE_FP32=compute_fp32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out

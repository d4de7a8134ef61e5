"""Multi-head Latent Attention (DeepSeek-V2/V3) over a paged latent cache.

MLA caches one row per token, shared by every head: the compressed latent c (kv_lora_rank = R
values, 512 in DeepSeek-V3) and the rotary key kr (qk_rope_head_dim = P values, 64), so the cache
of a layer is [num_blocks, block_size, R + P] with token i of a sequence at slot
`block_table[i // block_size] * block_size + i % block_size`. Per-head keys and values are
linear in c (k_nope = W_uk c, v = W_uv c), which gives the two ways to attend:

- Decode, absorbed. W_uk is folded into the query (q_latent = W_ukᵀ q_nope, done by the model)
  and W_uv is applied to the output, so attention runs in the latent space straight over the
  cache: score = scale * (q_latent·c + q_rope·kr) and out = softmax(score) @ c, an MQA with key
  dim R + P and value dim R. Nothing per head is ever materialised per cached token.
- Prefill, decompressed. With many new tokens, decompressing keys [T, H, 192] and values
  [T, H, 128] costs less than attending in the 576-wide latent space, so prefill is ordinary
  causal attention with a query/key head dim different from the value head dim.

`store_latent_*` writes this step's rows into the cache (slot -1 skipped), `mla_decode_*` is the
absorbed decode over the first `batch.num_decode` sequences of a `PagedAttentionBatch`, and
`mla_prefill_*` is the decompressed attention of the step's prefill segments, whose queries are
the last tokens of each segment's keys (bottom-right causal, covering cached prefixes).

Cache slots outside a context may hold any finite values; every kernel masks them out.

The Triton kernels:

- `_mla_decode_split_kernel` is stage 1 of split-KV flash-decoding (`split_kv`), as in
  `decode_attention`: it keeps an online softmax over one contiguous range of a context and
  writes a normalised partial and its log-sum-exp; `split_kv.merge_splits` weighs the partials
  into the exact softmax. All heads read the same cache row, so a program serves a block of 16
  heads with `tl.dot` (16 is a tensor core's smallest M). The head blocks of one (sequence,
  split) are the fastest grid axis: they run side by side and read the same tiles, so all but
  the first read hit L2.
- R and P need not be powers of two: the latent and rope parts are loaded with separate masked
  ranges (512 and 64 in DeepSeek-V3, so nothing is padded there).
- `_mla_prefill_kernel` is a FlashAttention-2 forward pass over packed segments, one launch for
  all of them: grid (query tiles, segment, head), tiles issued last-first (the latest rows have
  the most keys). Keys every row of a tile sees are walked unmasked; only the tiles across the
  diagonal pay for the causal mask. The query/key head dim is read as two power-of-two parts
  (192 = 128 + 64), so a non-power-of-two dim is not padded to the next power of two.

Arithmetic is float32 on the CPU interpreter (which computes bf16 wrongly) and for float32
inputs; on CUDA, bf16/fp16 operands feed `tl.dot` directly with float32 accumulation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.attention import PagedAttentionBatch
from kernels.online_softmax import fold_scores
from kernels.split_kv import empty_partials, merge_splits, split_plan, store_partial

# Smallest M, N and K of a tensor-core `tl.dot`: head blocks and head-dim parts are padded to it.
_MIN_DOT = 16
# Tokens per decode tile: a [32, 576] bf16 tile is 36 KiB, two pipeline stages fit with room.
_DECODE_BLOCK_N = 32
_DECODE_BLOCK_H = 16


def store_latent_torch(
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write latent [T, R] and rope_key [T, P] as rows [c | kr] of `cache` [num_blocks,
    block_size, R + P] at `slot_mapping` int64 [T]; slot -1 is skipped."""
    rows = cache.view(-1, cache.shape[-1])
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        valid = slot_mapping >= 0
        latent, rope_key, slot_mapping = latent[valid], rope_key[valid], slot_mapping[valid]
    rows.index_copy_(0, slot_mapping, torch.cat([latent, rope_key], dim=-1))


@triton.jit
def _store_latent_kernel(
    latent_ptr,
    rope_key_ptr,
    cache_ptr,
    slot_ptr,
    stride_latent,
    stride_rope,
    LATENT_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        row_ptr = cache_ptr + slot * (LATENT_DIM + ROPE_DIM)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < LATENT_DIM
        latent = tl.load(latent_ptr + token * stride_latent + offs_r, mask=r_mask)
        tl.store(row_ptr + offs_r, latent, mask=r_mask)
        offs_p = tl.arange(0, BLOCK_P)
        p_mask = offs_p < ROPE_DIM
        rope_key = tl.load(rope_key_ptr + token * stride_rope + offs_p, mask=p_mask)
        tl.store(row_ptr + LATENT_DIM + offs_p, rope_key, mask=p_mask)


def store_latent_triton(
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton `store_latent_torch`: one program per token copies its row; latent and rope_key
    may be strided views of the projection output (their last dim contiguous)."""
    num_tokens, latent_dim = latent.shape
    rope_dim = rope_key.shape[1]
    if num_tokens == 0:
        return
    assert cache.is_contiguous() and cache.shape[-1] == latent_dim + rope_dim
    assert latent.stride(-1) == 1 and rope_key.stride(-1) == 1, "the last dim must be contiguous"
    _store_latent_kernel[(num_tokens,)](
        latent,
        rope_key,
        cache,
        slot_mapping,
        latent.stride(0),
        rope_key.stride(0),
        LATENT_DIM=latent_dim,
        ROPE_DIM=rope_dim,
        BLOCK_R=triton.next_power_of_2(latent_dim),
        BLOCK_P=triton.next_power_of_2(rope_dim),
    )


def mla_decode_torch(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    batch: PagedAttentionBatch,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode of the batch's first `batch.num_decode` sequences (reference).

    q_latent [N, H, R] and q_rope [N, H, P] are each decoding sequence's query; cache is
    [num_blocks, block_size, R + P]. Returns softmax(scale * (q_latent·c + q_rope·kr)) @ c over
    each context, [N, H, R] in q_latent's dtype, written into `out` when given.
    """
    num_seqs, _, latent_dim = q_latent.shape
    assert num_seqs == batch.num_decode, "one query per decoding sequence"
    if out is None:
        out = torch.empty_like(q_latent)
    if num_seqs == 0:
        return out
    row_width = cache.shape[-1]
    # One gather for every sequence, [N, 1, L, R + P]: a single "KV head" that all heads share.
    rows = cache.view(-1, row_width).index_select(0, batch.decode_slots.view(-1))
    rows = rows.view(num_seqs, 1, -1, row_width)
    # The heads of a sequence become the query rows of that one KV head (MQA).
    query = torch.cat([q_latent, q_rope], dim=-1).unsqueeze(1)
    attended = F.scaled_dot_product_attention(
        query, rows, rows[..., :latent_dim], attn_mask=batch.decode_mask, scale=scale
    )
    out.copy_(attended.squeeze(1))
    return out


@triton.jit
def _mla_decode_split_kernel(
    q_latent_ptr,
    q_rope_ptr,
    cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    num_heads,
    num_splits,
    split_len,
    stride_qlb,
    stride_qlh,
    stride_qrb,
    stride_qrh,
    stride_bt,
    LATENT_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,
):
    head_block = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    split_start = split * split_len
    if split_start >= context_len:
        return
    split_end = tl.minimum(split_start + split_len, context_len)

    dot_dtype = tl.float32 if COMPUTE_FP32 else cache_ptr.dtype.element_ty

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < LATENT_DIM
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = offs_p < ROPE_DIM
    seq64 = seq.to(tl.int64)

    q_latent = tl.load(
        q_latent_ptr + seq64 * stride_qlb + heads[:, None] * stride_qlh + offs_r[None, :],
        mask=head_mask[:, None] & r_mask[None, :],
        other=0.0,
    ).to(dot_dtype)
    q_rope = tl.load(
        q_rope_ptr + seq64 * stride_qrb + heads[:, None] * stride_qrh + offs_p[None, :],
        mask=head_mask[:, None] & p_mask[None, :],
        other=0.0,
    ).to(dot_dtype)

    block_table_row = block_tables_ptr + seq64 * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for start in range(split_start, split_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < split_end
        # Masked so block-table entries past the context (arbitrary, may be -1) are never read.
        pages = tl.load(block_table_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        # The cache is contiguous: a slot's row starts at slot * (R + P).
        rows = (pages * PAGE_SIZE + offs_n % PAGE_SIZE) * (LATENT_DIM + ROPE_DIM)
        # The latent tile is loaded once, [N, R]: the value, and transposed, the key's first part.
        latent = tl.load(
            cache_ptr + rows[:, None] + offs_r[None, :],
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        ).to(dot_dtype)
        rope_key = tl.load(
            cache_ptr + rows[None, :] + LATENT_DIM + offs_p[:, None],
            mask=n_mask[None, :] & p_mask[:, None],
            other=0.0,
        ).to(dot_dtype)
        scores = tl.dot(q_latent, tl.trans(latent), input_precision="ieee")
        scores += tl.dot(q_rope, rope_key, input_precision="ieee")
        scores = tl.where(n_mask[None, :], scores * scale_log2, float("-inf"))
        # Every tile holds at least one valid token, so m_i stays finite and nothing is NaN.
        m_i, l_i, acc = fold_scores(scores, latent, m_i, l_i, acc, dot_dtype)

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
        offs_r,
        r_mask,
        LATENT_DIM,
    )


def _mla_split_plan(
    num_seqs: int, head_blocks: int, max_context: int, device: torch.device
) -> tuple[int, int]:
    """(num_splits, split_len) of stage 1, whose programs each serve one block of heads."""
    return split_plan(num_seqs * head_blocks, max_context, _DECODE_BLOCK_N, device)


def _dot_block(dim: int) -> int:
    """A dim padded to a power of two that `tl.dot` accepts."""
    return max(_MIN_DOT, triton.next_power_of_2(dim))


def mla_decode_triton(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    batch: PagedAttentionBatch,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split-KV Triton absorbed decode; same contract as `mla_decode_torch`.

    Reads the block tables and context lengths of `batch.kernel_batch()`. The splits are planned
    from the block table's width (an upper bound on the longest context, known on the host), so
    nothing is read back from the GPU.
    """
    num_seqs, num_heads, latent_dim = q_latent.shape
    rope_dim = q_rope.shape[-1]
    page_size = cache.shape[1]
    assert num_seqs == batch.num_decode, "one query per decoding sequence"
    if out is None:
        out = torch.empty_like(q_latent)
    if num_seqs == 0:
        return out
    q_latent, q_rope = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_latent, q_rope))
    assert cache.is_contiguous() and cache.shape[-1] == latent_dim + rope_dim
    assert out.stride(-1) == 1, "out must be contiguous in its last dimension"
    layout = batch.kernel_batch()
    block_tables, context_lens = layout.block_tables[:num_seqs], layout.context_lens[:num_seqs]

    head_blocks = triton.cdiv(num_heads, _DECODE_BLOCK_H)
    num_splits, split_len = _mla_split_plan(
        num_seqs, head_blocks, block_tables.shape[1] * page_size, q_latent.device
    )
    partial_out, partial_lse = empty_partials(
        num_seqs, num_heads, num_splits, latent_dim, out.device
    )
    compute_fp32 = not q_latent.is_cuda or q_latent.dtype == torch.float32

    _mla_decode_split_kernel[(head_blocks, num_seqs, num_splits)](
        q_latent,
        q_rope,
        cache,
        block_tables,
        context_lens,
        partial_out,
        partial_lse,
        scale * math.log2(math.e),
        num_heads,
        num_splits,
        split_len,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        block_tables.stride(0),
        LATENT_DIM=latent_dim,
        ROPE_DIM=rope_dim,
        PAGE_SIZE=page_size,
        BLOCK_H=_DECODE_BLOCK_H,
        BLOCK_R=_dot_block(latent_dim),
        BLOCK_P=_dot_block(rope_dim),
        BLOCK_N=_DECODE_BLOCK_N,
        COMPUTE_FP32=compute_fp32,
        num_warps=4,
        num_stages=2,
    )
    # One split's row at a time: a [splits, 512] float32 tile would not fit in registers.
    merge_splits(partial_out, partial_lse, context_lens, split_len, out, 1)
    return out


def mla_prefill_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    key_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decompressed MLA attention of the step's prefill segments (reference).

    query [Tq, H, Dqk], key [Tk, H, Dqk], value [Tk, H, Dv]; query_start_loc and key_start_loc
    int32 [S + 1] delimit the segments. A segment's q_len queries are the last of its k_len
    keys: query i sees keys j <= k_len - q_len + i. Returns [Tq, H, Dv] in query's dtype,
    written into `out` when given.
    """
    num_heads, value_dim = query.shape[1], value.shape[-1]
    if out is None:
        out = query.new_empty((query.shape[0], num_heads, value_dim))
    query_starts, key_starts = query_start_loc.tolist(), key_start_loc.tolist()
    for segment in range(len(query_starts) - 1):
        q_start, q_end = query_starts[segment], query_starts[segment + 1]
        k_start, k_end = key_starts[segment], key_starts[segment + 1]
        query_len, key_len = q_end - q_start, k_end - k_start
        q = query[q_start:q_end].transpose(0, 1)
        k = key[k_start:k_end].transpose(0, 1)
        v = value[k_start:k_end].transpose(0, 1)
        if query_len == key_len:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            visible = torch.ones(query_len, key_len, dtype=torch.bool, device=query.device)
            visible = visible.tril(diagonal=key_len - query_len)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
        out[q_start:q_end] = attended.transpose(0, 1)
    return out


@triton.jit
def _attend_key_tile(
    q,
    q_tail,
    key_head_ptr,
    value_head_ptr,
    key_rows,
    n_mask,
    prefix_len,
    offs_m,
    offs_v,
    v_mask,
    m_i,
    l_i,
    acc,
    scale_log2,
    stride_kt,
    stride_vt,
    QK_DIM: tl.constexpr,
    BLOCK_QK: tl.constexpr,
    BLOCK_QK_TAIL: tl.constexpr,
    CAUSAL: tl.constexpr,
    dot_dtype: tl.constexpr,
):
    """Fold the keys and values at `key_rows` into the query tile's running softmax.

    With CAUSAL, query row `offs_m` (after `prefix_len` keys) sees the keys within `n_mask` up
    to its own position; without, every row sees the whole tile, so its values load unmasked.
    """
    # Q·Kᵀ, unscaled, with K read transposed in the same two parts as Q.
    offs_d = tl.arange(0, BLOCK_QK)
    k = tl.load(
        key_head_ptr + key_rows[None, :] * stride_kt + offs_d[:, None],
        mask=n_mask[None, :] & (offs_d[:, None] < QK_DIM),
        other=0.0,
    )
    scores = tl.dot(q, k.to(dot_dtype), input_precision="ieee")
    if BLOCK_QK_TAIL > 0:
        offs_t = BLOCK_QK + tl.arange(0, BLOCK_QK_TAIL)
        k_tail = tl.load(
            key_head_ptr + key_rows[None, :] * stride_kt + offs_t[:, None],
            mask=n_mask[None, :] & (offs_t[:, None] < QK_DIM),
            other=0.0,
        )
        scores += tl.dot(q_tail, k_tail.to(dot_dtype), input_precision="ieee")
    value_tile_ptr = value_head_ptr + key_rows[:, None] * stride_vt + offs_v[None, :]
    if CAUSAL:
        v = tl.load(value_tile_ptr, mask=n_mask[:, None] & v_mask[None, :], other=0.0)
        visible = (key_rows[None, :] <= prefix_len + offs_m[:, None]) & n_mask[None, :]
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
    else:
        v = tl.load(value_tile_ptr, mask=v_mask[None, :], other=0.0)
        scores = scores * scale_log2
    return fold_scores(scores, v, m_i, l_i, acc, dot_dtype)


@triton.jit
def _mla_prefill_kernel(
    query_ptr,
    key_ptr,
    value_ptr,
    query_start_loc_ptr,
    key_start_loc_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    QK_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_QK: tl.constexpr,
    BLOCK_QK_TAIL: tl.constexpr,
    BLOCK_V: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    segment = tl.program_id(1)
    head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + segment)
    query_len = tl.load(query_start_loc_ptr + segment + 1) - query_start
    tile_start = tile * BLOCK_M
    if tile_start >= query_len:
        return
    key_start = tl.load(key_start_loc_ptr + segment)
    prefix_len = tl.load(key_start_loc_ptr + segment + 1) - key_start - query_len

    dot_dtype = tl.float32 if COMPUTE_FP32 else query_ptr.dtype.element_ty

    offs_m = tile_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < query_len
    query_rows = (query_start + offs_m).to(tl.int64)
    query_head_ptr = query_ptr + query_rows[:, None] * stride_qt + head * stride_qh
    offs_d = tl.arange(0, BLOCK_QK)
    q = tl.load(
        query_head_ptr + offs_d[None, :],
        mask=m_mask[:, None] & (offs_d[None, :] < QK_DIM),
        other=0.0,
    ).to(dot_dtype)
    q_tail = None
    if BLOCK_QK_TAIL > 0:
        offs_t = BLOCK_QK + tl.arange(0, BLOCK_QK_TAIL)
        q_tail = tl.load(
            query_head_ptr + offs_t[None, :],
            mask=m_mask[:, None] & (offs_t[None, :] < QK_DIM),
            other=0.0,
        ).to(dot_dtype)
    offs_v = tl.arange(0, BLOCK_V)
    v_mask = offs_v < V_DIM
    offs_n = tl.arange(0, BLOCK_N)
    key_head_ptr = key_ptr + key_start.to(tl.int64) * stride_kt + head * stride_kh
    value_head_ptr = value_ptr + key_start.to(tl.int64) * stride_vt + head * stride_vh

    # Every row sees key 0, so its first tile holds a key it sees, as the online softmax needs.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)

    # Keys before the tile's first query position are seen by every row: whole tiles, no mask.
    seen_by_all = prefix_len + tile_start
    for start in range(0, seen_by_all // BLOCK_N * BLOCK_N, BLOCK_N):
        key_rows = start + offs_n
        m_i, l_i, acc = _attend_key_tile(
            q,
            q_tail,
            key_head_ptr,
            value_head_ptr,
            key_rows,
            key_rows < seen_by_all,
            prefix_len,
            offs_m,
            offs_v,
            v_mask,
            m_i,
            l_i,
            acc,
            scale_log2,
            stride_kt,
            stride_vt,
            QK_DIM,
            BLOCK_QK,
            BLOCK_QK_TAIL,
            False,
            dot_dtype,
        )

    # The rest, up to the tile's last query position: the causal mask.
    seen_by_last = prefix_len + tl.minimum(tile_start + BLOCK_M, query_len)
    for start in range(seen_by_all // BLOCK_N * BLOCK_N, seen_by_last, BLOCK_N):
        key_rows = start + offs_n
        m_i, l_i, acc = _attend_key_tile(
            q,
            q_tail,
            key_head_ptr,
            value_head_ptr,
            key_rows,
            key_rows < seen_by_last,
            prefix_len,
            offs_m,
            offs_v,
            v_mask,
            m_i,
            l_i,
            acc,
            scale_log2,
            stride_kt,
            stride_vt,
            QK_DIM,
            BLOCK_QK,
            BLOCK_QK_TAIL,
            True,
            dot_dtype,
        )

    tl.store(
        out_ptr + query_rows[:, None] * stride_ot + head * stride_oh + offs_v[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & v_mask[None, :],
    )


def _split_head_dim(dim: int) -> tuple[int, int]:
    """(main, tail) blocks covering `dim`: the largest power of two within it, then the rest
    padded to a power of two (0 when nothing is left), each at least `tl.dot`'s minimum."""
    main = max(_MIN_DOT, 1 << (dim.bit_length() - 1))
    return main, (_dot_block(dim - main) if dim > main else 0)


def _prefill_tile_config(qk_row_bytes: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for query/key rows of `qk_row_bytes`.

    Up to 384 bytes (bf16 with Dqk <= 192) Hopper's FlashAttention-2 tiles fit: Q 48 KiB plus
    3 stages of K (24 KiB) and V (16 KiB at Dv = 128). Wider rows (float32) halve the tiles.
    """
    if qk_row_bytes <= 384:
        return 128, 64, 8, 3
    return 64, 32, 4, 2


def mla_prefill_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    key_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One-launch Triton FlashAttention over packed segments; same contract as
    `mla_prefill_torch`.

    Reads the longest segment's query count back to the host (one sync per call) to size the
    grid.
    """
    num_queries, num_heads, qk_dim = query.shape
    value_dim = value.shape[-1]
    num_segments = query_start_loc.shape[0] - 1
    if out is None:
        out = query.new_empty((num_queries, num_heads, value_dim))
    if num_segments == 0 or num_queries == 0:
        return out
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    assert out.stride(-1) == 1, "out must be contiguous in its last dimension"

    max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_qk, block_qk_tail = _split_head_dim(qk_dim)
    block_m, block_n, num_warps, num_stages = _prefill_tile_config(
        (block_qk + block_qk_tail) * query.element_size()
    )
    compute_fp32 = not query.is_cuda or query.dtype == torch.float32

    _mla_prefill_kernel[(triton.cdiv(max_query_len, block_m), num_segments, num_heads)](
        query,
        key,
        value,
        query_start_loc,
        key_start_loc,
        out,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        out.stride(0),
        out.stride(1),
        QK_DIM=qk_dim,
        V_DIM=value_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_QK=block_qk,
        BLOCK_QK_TAIL=block_qk_tail,
        BLOCK_V=_dot_block(value_dim),
        COMPUTE_FP32=compute_fp32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out

"""Paged KV cache writes and attention over it.

The cache of one layer is a tensor [num_blocks, block_size, num_kv_heads, head_dim]; a sequence's
tokens live in the blocks its block table lists, token i at slot
`block_table[i // block_size] * block_size + i % block_size`.

`PagedAttentionBatch` describes one engine step: decoding sequences (one new token each) come
first in the flattened token dimension and are handled together; sequences that bring several new
tokens (prefill, chunked prefill, prefill after a prefix-cache hit) follow, each with its own
causal mask over its cached prefix and its new tokens. It is built once per step and reused by
every layer.

Cache slots outside a sequence's context may hold any finite values (stale KV of freed blocks):
decode attention pads ragged contexts with such slots and masks them out of the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.decode_attention import decode_attention_triton
from kernels.extend_attention import extend_attention_triton


@dataclass
class PrefillSegment:
    """One sequence with several new tokens in the step."""

    query_start: int
    query_len: int
    context_len: int  # cached prefix + new tokens
    slots: torch.Tensor | None  # [context_len] cache slots, None when there is no cached prefix
    mask: torch.Tensor | None  # [query_len, context_len] bool, None when there is no prefix


@dataclass
class KernelBatch:
    """The step's layout as the Triton kernels read it (int32 tensors on the step's device)."""

    block_tables: torch.Tensor  # [B, max_blocks], padded with 0 (never read past a context)
    context_lens: torch.Tensor  # [B] cached prefix + new tokens
    prefix_lens: torch.Tensor  # [B] cached prefix only
    query_start_loc: torch.Tensor  # [B + 1] where each sequence's new tokens start


@dataclass
class PagedAttentionBatch:
    """Layout of one step's batch for `paged_attention`."""

    num_decode: int
    decode_slots: torch.Tensor | None  # [num_decode, max_context] slot per (sequence, position)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_context] True where attended
    prefills: list[PrefillSegment]
    block_tables: list[list[int]] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    device: torch.device | str = "cpu"
    _kernel_batch: KernelBatch | None = None
    # kernels.invariant_attention's per-split slots and masks, built on first use per step.
    _split_plan: object | None = None

    def kernel_batch(self) -> KernelBatch:
        """The tensors the Triton kernels take, built on first use and shared by every layer
        (the PyTorch reference never needs them)."""
        if self._kernel_batch is None:
            width = max((len(blocks) for blocks in self.block_tables), default=0)
            table = torch.zeros((len(self.block_tables), max(width, 1)), dtype=torch.int32)
            for row, blocks in enumerate(self.block_tables):
                table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            context = torch.tensor(self.context_lens, dtype=torch.int32)
            query = torch.tensor(self.query_lens, dtype=torch.int32)
            starts = torch.zeros(len(self.query_lens) + 1, dtype=torch.int32)
            starts[1:] = query.cumsum(0)
            self._kernel_batch = KernelBatch(
                table.to(self.device),
                context.to(self.device),
                (context - query).to(self.device),
                starts.to(self.device),
            )
        return self._kernel_batch


def build_paged_attention_batch(
    block_tables: list[list[int]],
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> PagedAttentionBatch:
    """Build the step layout. Sequences with query_len == 1 must come first."""
    num_decode = 0
    while num_decode < len(query_lens) and query_lens[num_decode] == 1:
        num_decode += 1
    decode_slots = decode_mask = None
    if num_decode:
        max_context = max(context_lens[:num_decode])
        max_blocks = -(-max_context // block_size)
        # One tensor from padded rows: a tensor per row costs every decode step a tensor's
        # construction per sequence (docs/performance.md).
        rows = [blocks[:max_blocks] for blocks in block_tables[:num_decode]]
        padded = [row + [0] * (max_blocks - len(row)) for row in rows]
        table = torch.tensor(padded, dtype=torch.long)
        offsets = torch.arange(block_size, dtype=torch.long)
        decode_slots = (table.unsqueeze(-1) * block_size + offsets).view(num_decode, -1)
        decode_slots = decode_slots[:, :max_context].contiguous().to(device)
        lens = torch.tensor(context_lens[:num_decode], dtype=torch.long)
        decode_mask = (torch.arange(max_context).unsqueeze(0) < lens.unsqueeze(1)).to(device)
        decode_mask = decode_mask.view(num_decode, 1, 1, max_context)
    prefills = []
    start = num_decode
    for blocks, query_len, context_len in zip(
        block_tables[num_decode:], query_lens[num_decode:], context_lens[num_decode:], strict=True
    ):
        slots = mask = None
        if context_len > query_len:
            positions = torch.arange(context_len, dtype=torch.long)
            table = torch.tensor(blocks, dtype=torch.long)
            slots = (table[positions // block_size] * block_size + positions % block_size).to(
                device
            )
            prefix = context_len - query_len
            rows = torch.arange(query_len).unsqueeze(1)
            mask = (positions.unsqueeze(0) <= rows + prefix).to(device)
        prefills.append(PrefillSegment(start, query_len, context_len, slots, mask))
        start += query_len
    return PagedAttentionBatch(
        num_decode,
        decode_slots,
        decode_mask,
        prefills,
        # Kept as given, not copied: kernel_batch() reads them within this step, before the
        # scheduler changes any block table again.
        block_tables,
        query_lens,
        context_lens,
        device,
    )


def store_kvcache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hk, D] into the caches at `slot_mapping` [T]; slot -1 is skipped."""
    k_flat = k_cache.view(-1, *k_cache.shape[-2:])
    v_flat = v_cache.view(-1, *v_cache.shape[-2:])
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_flat.index_copy_(0, slot_mapping, key)
    v_flat.index_copy_(0, slot_mapping, value)


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        # The cache is contiguous, so one slot is num_kv_heads * head_dim consecutive elements.
        cache_offsets = slot * num_kv_heads * head_dim + heads * head_dim + dims
        key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask)
        tl.store(k_cache_ptr + cache_offsets, key, mask=mask)
        value = tl.load(
            value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask
        )
        tl.store(v_cache_ptr + cache_offsets, value, mask=mask)


def store_kvcache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton `store_kvcache_torch`: one program per token copies its keys and values (every KV
    head) into its slot; key/value may be strided views of the fused projection."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "the head dim must be contiguous"
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def paged_attention_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedAttentionBatch,
    scale: float,
) -> torch.Tensor:
    """Attention of query [T, Hq, D] over each sequence's cached context.

    `key`/`value` are this step's new keys and values [T, Hk, D], already written to the cache;
    a sequence without a cached prefix attends to them directly instead of reading them back.
    Returns [T, Hq * D].
    """
    _, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    parts: list[torch.Tensor] = []  # outputs in token order: decodes first, then each prefill
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)

    if batch.num_decode:
        n = batch.num_decode
        # GQA without copying K/V: the query heads that share a KV head become that head's
        # "query rows", so K/V stay [n, Hk, L, D].
        q = query[:n].view(n, num_kv_heads, group, head_dim)
        slots = batch.decode_slots
        k = k_flat.index_select(0, slots.view(-1)).view(n, -1, num_kv_heads, head_dim)
        v = v_flat.index_select(0, slots.view(-1)).view(n, -1, num_kv_heads, head_dim)
        attn = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=batch.decode_mask, scale=scale
        )
        parts.append(attn.reshape(n, num_heads * head_dim))

    for seg in batch.prefills:
        rows = slice(seg.query_start, seg.query_start + seg.query_len)
        q = query[rows].transpose(0, 1).unsqueeze(0)
        if seg.slots is None:
            k = key[rows].transpose(0, 1).unsqueeze(0)
            v = value[rows].transpose(0, 1).unsqueeze(0)
            attn = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            k = k_flat.index_select(0, seg.slots).transpose(0, 1).unsqueeze(0)
            v = v_flat.index_select(0, seg.slots).transpose(0, 1).unsqueeze(0)
            attn = F.scaled_dot_product_attention(
                q, k, v, attn_mask=seg.mask, scale=scale, enable_gqa=group > 1
            )
        parts.append(attn[0].transpose(0, 1).reshape(seg.query_len, num_heads * head_dim))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def paged_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedAttentionBatch,
    scale: float,
) -> torch.Tensor:
    """Triton `paged_attention_torch`: one split-KV decode launch for the decoding sequences and
    one extend launch for every sequence with several new tokens (its cached prefix read through
    the block table, its new tokens' own causal triangle from `key`/`value`)."""
    num_tokens, num_heads, head_dim = query.shape
    # The engine's query/key/value are views into the fused projection; the kernels take
    # contiguous rows (a copy of this step's new tokens only, small beside the cache reads).
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    layout = batch.kernel_batch()
    n = batch.num_decode
    if n:
        decode_attention_triton(
            query[:n],
            k_cache,
            v_cache,
            layout.block_tables[:n],
            layout.context_lens[:n],
            scale,
            out=out[:n],
        )
    if n < num_tokens:
        extend_attention_triton(
            query[n:],
            key[n:],
            value[n:],
            k_cache,
            v_cache,
            layout.block_tables[n:],
            layout.query_start_loc[n:] - n,
            layout.prefix_lens[n:],
            scale,
            out=out[n:],
        )
    return out.view(num_tokens, num_heads * head_dim)

"""Attention over the paged cache whose result for a query does not depend on the step.

`paged_attention_torch` hands each sequence to torch's flash kernel, which splits the keys by
the context's length (a split of 512 keys from 512 on, the whole context below) and pads a
decode batch to its longest context: the same query sums its keys in a different order in a
cold prefill, a chunked prefill and a decode, and in bfloat16 that can change a token.

Here every query sees its keys in fixed splits of `KEY_SPLIT` positions counted from the start
of its sequence (0–255, 256–511, …), whatever else the step holds:

- each split's scores are one batched matmul over exactly `KEY_SPLIT` keys (a short last split
  is padded and masked), its softmax row-wise in float32, its values one more batched matmul
  (probabilities rounded to the model's dtype first, as a flash kernel does);
- the splits are merged in position order with an online softmax in float32, element-wise.

torch's own flash kernel can't be used per split: for few query rows it splits the keys across
threads (flash decoding), and its log-sum-exp then depends on the row count.

A query's rows go through the same matmuls with the same keys in every kind of step, and the
merge is element-wise, so the result is invariant wherever torch's batched matmul keeps a row's
bits for any row count: bfloat16 through oneDNN on a CPU with native bf16 (checked on the machine
at hand by `kernels.batch_invariance.matmul_rows_keep_their_bits`; float32 through the BLAS does
not, and deterministic mode refuses a dtype that fails the check).

A decode row whose sequence ends before a split the batch reaches gets that split
fully masked, which the merge leaves exactly unchanged (weight 0, rescale 1), so it matches a
prefill row that skips it. Keys always come from the cache (this step's new keys are written
before attention).

The step's sequences go in groups, each one batched matmul per split: the decodes together, the
short prefills together (padded to the longest; padding rows see no key), each long prefill on
its own (its rows before a split skip it). The per-split slots and masks are built once per step
(`SplitPlan`) and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.batch_invariance import batched_matmul

KEY_SPLIT = 256


# A prefill of up to this many new tokens is batched with the other short ones.
SHORT_PREFILL = 128


@dataclass
class SplitGroup:
    """Sequences whose queries go through the splits together: items of `rows` query rows
    each (a token's query heads of one KV head are `group_size` consecutive rows; shorter items
    are padded with rows that see no key)."""

    token_index: torch.Tensor  # [items * tokens_per_item] the step's token of each row block
    live_rows: torch.Tensor  # which of those are real tokens, not padding
    live_tokens: torch.Tensor  # the step's tokens they are, in the same order
    tokens_per_item: int
    # The step's tokens as one slice when the group's rows are exactly them, in order (the
    # decodes, a long prefill): then no gather or scatter is needed.
    token_slice: slice | None
    # Per split: the cache slots of its keys [items, KEY_SPLIT], the additive mask
    # [1, items, rows, KEY_SPLIT] over the rows from the first that reaches it, that row, and
    # which rows see any of its keys [1, items, rows] (None: all do).
    slots: list[torch.Tensor]
    masks: list[torch.Tensor]
    first_rows: list[int]
    seen: list[torch.Tensor | None]


@dataclass
class SplitPlan:
    groups: list[SplitGroup]


def split_plan(batch, group_size: int, block_size: int) -> SplitPlan:
    """The step's plan for `batch` (a `PagedAttentionBatch` over a cache of `block_size`-token
    blocks), built on first use per step and shared by every layer."""
    cached = batch._split_plan
    if cached is not None:
        return cached
    starts = [0]
    for query_len in batch.query_lens:
        starts.append(starts[-1] + query_len)
    items = list(range(len(batch.query_lens)))
    decodes = [i for i in items if batch.query_lens[i] == 1]
    short = [i for i in items if 1 < batch.query_lens[i] <= SHORT_PREFILL]
    long = [[i] for i in items if batch.query_lens[i] > SHORT_PREFILL]
    groups = [
        _group(batch, members, starts, group_size, block_size)
        for members in [decodes, short, *long]
        if members
    ]
    plan = SplitPlan(groups)
    batch._split_plan = plan
    return plan


def _group(batch, members: list[int], starts: list[int], group_size: int, block_size: int):
    device = batch.device
    query_lens = [batch.query_lens[i] for i in members]
    context_lens = [batch.context_lens[i] for i in members]
    width = max(query_lens)
    count = len(members)
    # Each item's tokens (padding repeats its first) and their positions (padding: -1).
    offsets = torch.arange(width)
    lens = torch.tensor(query_lens)
    live = offsets.unsqueeze(0) < lens.unsqueeze(1)  # [items, width]
    first_tokens = torch.tensor([starts[i] for i in members])
    token_index = torch.where(live, first_tokens.unsqueeze(1) + offsets, first_tokens.unsqueeze(1))
    prefixes = torch.tensor(context_lens) - lens
    positions = torch.where(live, prefixes.unsqueeze(1) + offsets, -1)
    row_positions = positions.repeat_interleave(group_size, dim=1)  # [items, rows]
    splits = -(-max(context_lens) // KEY_SPLIT)
    slots = torch.zeros(count, splits * KEY_SPLIT, dtype=torch.long)
    for row, item in enumerate(members):
        table = torch.tensor(batch.block_tables[item], dtype=torch.long)
        position = torch.arange(context_lens[row])
        slots[row, : context_lens[row]] = table[position // block_size] * block_size + (
            position % block_size
        )
    split_slots, masks, first_rows, seen = [], [], [], []
    key_offsets = torch.arange(KEY_SPLIT)
    for split in range(splits):
        start = split * KEY_SPLIT
        first_row = 0
        if count == 1:
            # One sequence: its rows are in position order; those before the split skip it.
            first_row = int(torch.searchsorted(row_positions[0], start))
        rows = row_positions[:, first_row:]
        visible = (start + key_offsets).view(1, 1, -1) <= rows.unsqueeze(-1)
        masks.append(_additive(visible).unsqueeze(0).to(device))
        sees = visible.any(-1)
        seen.append(None if bool(sees.all()) else sees.unsqueeze(0).to(device))
        first_rows.append(first_row)
        split_slots.append(slots[:, start : start + KEY_SPLIT].to(device))
    flat_live = live.reshape(-1)
    flat_tokens = token_index.reshape(-1)
    first = int(flat_tokens[0])
    contiguous = bool(flat_live.all()) and torch.equal(
        flat_tokens, torch.arange(first, first + flat_tokens.shape[0])
    )
    return SplitGroup(
        token_index=token_index.reshape(-1).to(device),
        live_rows=flat_live.nonzero().squeeze(1).to(device),
        live_tokens=token_index.reshape(-1)[flat_live].to(device),
        tokens_per_item=width,
        token_slice=slice(first, first + flat_tokens.shape[0]) if contiguous else None,
        slots=split_slots,
        masks=masks,
        first_rows=first_rows,
        seen=seen,
    )


def _additive(visible: torch.Tensor) -> torch.Tensor:
    """0 where a key is visible, -inf where it is not (float32, added to the scores)."""
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))


def paged_attention_invariant_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch,
    scale: float,
) -> torch.Tensor:
    """`paged_attention_torch`'s result (within rounding), with each query's keys summed in
    fixed splits: the same bits for a query whatever shares its step. `key`/`value` are
    already in the cache, which is where the keys are read from. Returns [T, Hq * D]."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group_size = num_heads // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=query.dtype, device=query.device)
    for group in split_plan(batch, group_size, k_cache.shape[1]).groups:
        items = group.slots[0].shape[0]
        width = group.tokens_per_item
        # [KV heads, items, rows, D]: the keys are gathered in the same order, so each
        # (head, item) is one bmm item.
        own = (
            query[group.token_slice]
            if group.token_slice is not None
            else query.index_select(0, group.token_index)
        )
        rows = (
            own.reshape(items, width, num_kv_heads, group_size, head_dim)
            .permute(2, 0, 1, 3, 4)
            .reshape(num_kv_heads, items, width * group_size, head_dim)
        )
        merged = _merge_splits(rows, group, k_flat, v_flat, scale)
        merged = (
            merged.view(num_kv_heads, items, width, group_size, head_dim)
            .permute(1, 2, 0, 3, 4)
            .reshape(items * width, num_heads * head_dim)
        )
        if group.token_slice is not None:
            out[group.token_slice] = merged
        else:
            out.index_copy_(0, group.live_tokens, merged.index_select(0, group.live_rows))
    return out


def _merge_splits(rows, group: SplitGroup, k_flat, v_flat, scale):
    """Online softmax over the splits, in position order, in float32. `rows` is
    [KV heads, items, rows, D]; the result has its shape.

    The first split sets the running maximum, total and output (a padding row, which sees no
    key, ends as NaN and is dropped); each later split is merged into the rows that reach it."""
    best = total = acc = None
    for slots, mask, first_row, seen in zip(
        group.slots, group.masks, group.first_rows, group.seen, strict=True
    ):
        keys, values = _split_keys(slots, k_flat, v_flat)
        attending = rows[:, :, first_row:]
        # mask + scale * scores in one pass: the mask is 0 or -inf, so whether the kernel
        # fuses the multiply-add or not, a visible score is round(scale * score) either way.
        scores = torch.add(mask, batched_matmul(attending, keys.transpose(-1, -2)), alpha=scale)
        split_best = scores.amax(-1)
        shift = split_best
        if seen is not None:
            # A row that sees none of the split's keys (its sequence ends before it) has
            # split_best -inf: it is shifted by 0 instead (probabilities 0, not NaN), gets
            # weight 0 and rescale 1, and leaves the merge exactly as it was.
            shift = torch.where(seen, split_best, 0.0)
        probs = scores.sub_(shift.unsqueeze(-1)).exp_()
        split_total = probs.sum(-1)
        split_out = batched_matmul(probs.to(rows.dtype), values).float()
        if best is None:
            best, total, acc = split_best, split_total, split_out
            continue
        live = (slice(None), slice(None), slice(first_row, None))
        old_best = best[live]
        new_best = torch.maximum(old_best, split_best)
        keep = torch.exp(old_best - new_best)
        weight = torch.exp(split_best - new_best)
        # In place, in the rows that reach the split; the same roundings as out of place.
        total[live].mul_(keep).add_(weight * split_total)
        acc[live].mul_(keep.unsqueeze(-1)).add_(weight.unsqueeze(-1) * split_out)
        best[live] = new_best
    return acc.div_(total.unsqueeze(-1)).to(rows.dtype)


def _split_keys(slots: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor):
    """Keys and values of one split, contiguous [KV heads, items, KEY_SPLIT, D]: every split
    reaches the matmuls in this one layout."""
    count, flat = slots.shape[0], slots.reshape(-1)
    # Gathered slot-major (index_select along a strided dimension is slow), then made
    # head-major in one copy each.
    keys = k_flat.index_select(0, flat).transpose(0, 1).contiguous()
    values = v_flat.index_select(0, flat).transpose(0, 1).contiguous()
    shape = (keys.shape[0], count, KEY_SPLIT, keys.shape[-1])
    return keys.view(shape), values.view(shape)

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
prefill row that skips it. Keys always come from the cache's values (a sequence without a cached
prefix reads this step's `key`/`value`, the same values it has just written).

The per-split slots and masks are built once per step (`SplitPlan`) and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.batch_invariance import batched_matmul

KEY_SPLIT = 256


@dataclass
class SplitGroup:
    """Query rows that share their keys' source: the decoding sequences (one query each) or one
    sequence with several new tokens."""

    query_start: int
    query_len: int
    num_sequences: int  # decode: one per query; a prefill: 1
    # Per split: the cache slots of its keys [num_sequences, KEY_SPLIT] (None: the keys are
    # this step's own `key` rows, the sequence has no cached prefix), the additive mask
    # [1, num_sequences, rows, KEY_SPLIT] over the rows still attending, the first such row, and
    # for decodes which sequences see any key of the split [1, num_sequences, 1] (None: all do).
    slots: list[torch.Tensor | None]
    masks: list[torch.Tensor]
    first_rows: list[int]
    seen: list[torch.Tensor | None]


@dataclass
class SplitPlan:
    groups: list[SplitGroup]


def split_plan(batch, group_size: int) -> SplitPlan:
    """The step's plan for `batch` (a `PagedAttentionBatch`), built on first use per step.

    `group_size` is the number of query heads per KV head: a query token's heads sharing a KV
    head are `group_size` consecutive query rows."""
    cached = batch._split_plan
    if cached is not None:
        return cached
    device = batch.device
    groups = []
    offsets = torch.arange(KEY_SPLIT)
    if batch.num_decode:
        n = batch.num_decode
        lens = torch.tensor(batch.context_lens[:n], dtype=torch.long)
        width = batch.decode_slots.shape[1]
        splits = -(-width // KEY_SPLIT)
        padded = torch.zeros(n, splits * KEY_SPLIT, dtype=torch.long, device=device)
        padded[:, :width] = batch.decode_slots
        slots, masks, seen = [], [], []
        for split in range(splits):
            keys = split * KEY_SPLIT + offsets
            visible = keys.unsqueeze(0) < lens.unsqueeze(1)  # [n, KEY_SPLIT]
            mask = _additive(visible).view(1, n, 1, KEY_SPLIT)
            slots.append(padded[:, split * KEY_SPLIT : (split + 1) * KEY_SPLIT])
            masks.append(mask.expand(1, n, group_size, KEY_SPLIT).to(device))
            sees = visible.any(-1)
            seen.append(None if bool(sees.all()) else sees.view(1, n, 1).to(device))
        groups.append(SplitGroup(0, n, n, slots, masks, [0] * splits, seen))
    for seg in batch.prefills:
        prefix = seg.context_len - seg.query_len
        positions = prefix + torch.arange(seg.query_len)
        rows = positions.repeat_interleave(group_size)  # each token's heads of one KV head
        splits = -(-seg.context_len // KEY_SPLIT)
        slots, masks, first_rows = [], [], []
        for split in range(splits):
            start = split * KEY_SPLIT
            first_row = int(torch.searchsorted(rows, start))
            keys = start + offsets
            visible = keys.unsqueeze(0) <= rows[first_row:].unsqueeze(1)
            masks.append(_additive(visible).view(1, 1, -1, KEY_SPLIT).to(device))
            first_rows.append(first_row)
            if seg.slots is None:
                slots.append(None)
            else:
                split_slots = torch.zeros(KEY_SPLIT, dtype=torch.long, device=device)
                taken = seg.slots[start : start + KEY_SPLIT]
                split_slots[: taken.shape[0]] = taken
                slots.append(split_slots.view(1, KEY_SPLIT))
        groups.append(
            SplitGroup(seg.query_start, seg.query_len, 1, slots, masks, first_rows, [None] * splits)
        )
    plan = SplitPlan(groups)
    batch._split_plan = plan
    return plan


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
    fixed splits: the same bits for a query whatever shares its step. Returns [T, Hq * D]."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group_size = num_heads // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=query.dtype, device=query.device)
    for group in split_plan(batch, group_size).groups:
        tokens = slice(group.query_start, group.query_start + group.query_len)
        per_sequence = group.query_len // group.num_sequences
        # [KV heads, sequences, rows, D]: a token's query heads of one KV head are its rows, and
        # the keys are gathered in the same order, so each (head, sequence) is one bmm item.
        rows = (
            query[tokens]
            .reshape(group.num_sequences, per_sequence, num_kv_heads, group_size, head_dim)
            .permute(2, 0, 1, 3, 4)
            .reshape(num_kv_heads, group.num_sequences, per_sequence * group_size, head_dim)
        )
        merged = _merge_splits(rows, group, key[tokens], value[tokens], k_flat, v_flat, scale)
        out[tokens] = (
            merged.view(num_kv_heads, group.num_sequences, per_sequence, group_size, head_dim)
            .permute(1, 2, 0, 3, 4)
            .reshape(group.query_len, num_heads * head_dim)
        )
    return out


def _merge_splits(rows, group: SplitGroup, new_keys, new_values, k_flat, v_flat, scale):
    """Online softmax over the splits, in position order, in float32. `rows` is
    [KV heads, sequences, rows, D]; the result has its shape.

    Every row sees the first split (key 0 is visible to every query), which sets the running
    maximum, total and output; each later split is merged into the rows that reach it."""
    best = total = acc = None
    for split, (slots, mask, first_row, seen) in enumerate(
        zip(group.slots, group.masks, group.first_rows, group.seen, strict=True)
    ):
        keys, values = _split_keys(split, slots, new_keys, new_values, k_flat, v_flat)
        attending = rows[:, :, first_row:]
        scores = batched_matmul(attending, keys.transpose(-1, -2)).float()
        scores.mul_(scale).add_(mask)
        split_best = scores.amax(-1)
        shift = split_best
        if seen is not None:
            # A decode row that sees none of the split's keys (its sequence ends before it) has
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
        total[live] = total[live] * keep + weight * split_total
        acc[live] = acc[live] * keep.unsqueeze(-1) + weight.unsqueeze(-1) * split_out
        best[live] = new_best
    return acc.div_(total.unsqueeze(-1)).to(rows.dtype)


def _split_keys(split, slots, new_keys, new_values, k_flat, v_flat):
    """Keys and values of one split, contiguous [KV heads, sequences, KEY_SPLIT, D]: every
    split reaches the matmuls in this one layout."""
    if slots is None:
        start = split * KEY_SPLIT
        keys = new_keys[start : start + KEY_SPLIT]
        values = new_values[start : start + KEY_SPLIT]
        if keys.shape[0] < KEY_SPLIT:
            pad = KEY_SPLIT - keys.shape[0]
            keys = torch.cat([keys, keys.new_zeros(pad, *keys.shape[1:])])
            values = torch.cat([values, values.new_zeros(pad, *values.shape[1:])])
        return (
            keys.transpose(0, 1).contiguous().unsqueeze(1),
            values.transpose(0, 1).contiguous().unsqueeze(1),
        )
    count, flat = slots.shape[0], slots.reshape(-1)
    # Gathered slot-major (index_select along a strided dimension is slow), then made
    # head-major in one copy each.
    keys = k_flat.index_select(0, flat).transpose(0, 1).contiguous()
    values = v_flat.index_select(0, flat).transpose(0, 1).contiguous()
    return keys.view(keys.shape[0], count, KEY_SPLIT, -1), values.view(
        values.shape[0], count, KEY_SPLIT, -1
    )

"""Split-KV (flash-decoding): what the decode kernels share to spread a few contexts over a GPU.

A decode step has one query token per sequence, which gives too few programs to occupy a GPU,
so stage 1 also splits each context into `num_splits` contiguous ranges of `split_len` tokens,
one program each. Every program keeps an online softmax over its range and stores, with
`store_partial`, its output normalised by its own softmax sum and the range's log-sum-exp
(base 2). Stage 2, `merge_splits`, weighs each partial by exp2(lse_split - lse_total), which
gives exactly the softmax over the whole context. Splits that start past a short sequence's end
write nothing, and the merge skips them.

Partials are float32, [N, H, num_splits, D] and [N, H, num_splits], contiguous
(`empty_partials`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_MAX_SPLITS = 64
# Stage-1 programs to aim for, per streaming multiprocessor: several resident per SM hide memory
# latency, and several waves keep the last, partly filled wave a small part of the time (with 64
# sequences x 8 KV heads, one split would be 512 programs: 1.3 waves on an H200 if 3 fit per
# SM). Partials are small and stay in L2, so extra splits cost little. The CPU interpreter
# assumes an H200 (132 SMs) to exercise the same plan.
_PROGRAMS_PER_SM = 8
_ASSUMED_SM_COUNT = 132


@functools.lru_cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; an H200's 132 for any other device."""
    if device.type != "cuda":
        return _ASSUMED_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_plan(
    programs_per_split: int, max_context: int, tile_len: int, device: torch.device
) -> tuple[int, int]:
    """(num_splits, split_len) for a stage 1 of `programs_per_split` programs per split and
    tiles of `tile_len` tokens: enough programs to fill the GPU, whole tiles per split, at most
    64 splits, and none of them planned past `max_context`."""
    max_tiles = triton.cdiv(max_context, tile_len)
    wanted = triton.cdiv(_PROGRAMS_PER_SM * sm_count(device), programs_per_split)
    num_splits = max(1, min(wanted, max_tiles, _MAX_SPLITS))
    tiles_per_split = triton.cdiv(max_tiles, num_splits)
    return triton.cdiv(max_tiles, tiles_per_split), tiles_per_split * tile_len


def empty_partials(
    num_seqs: int, num_heads: int, num_splits: int, dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's outputs: partial outputs [N, H, num_splits, D] and log-sum-exps
    [N, H, num_splits], float32."""
    partial_out = torch.empty(
        (num_seqs, num_heads, num_splits, dim), dtype=torch.float32, device=device
    )
    partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=device)
    return partial_out, partial_lse


@triton.jit
def store_partial(
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
    DIM: tl.constexpr,
):
    """Store one split's online softmax of `heads` of sequence `seq64`: acc [H, D] normalised
    by its sum l_i, and its log-sum-exp m_i + log2(l_i)."""
    split_rows = (seq64 * num_heads + heads) * num_splits + split
    tl.store(
        partial_out_ptr + split_rows[:, None] * DIM + offs_d[None, :],
        acc / l_i[:, None],
        mask=head_mask[:, None] & d_mask[None, :],
    )
    tl.store(partial_lse_ptr + split_rows, m_i + tl.log2(l_i), mask=head_mask)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    context_lens_ptr,
    out_ptr,
    num_heads,
    num_splits,
    split_len,
    stride_ob,
    stride_oh,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SPLITS_PER_STEP: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    # Only the splits that start inside the context were written.
    written = tl.cdiv(context_len, split_len)
    offs_s = tl.arange(0, BLOCK_S)
    first_split = (seq.to(tl.int64) * num_heads + head) * num_splits
    lse = tl.load(
        partial_lse_ptr + first_split + offs_s, mask=offs_s < written, other=-float("inf")
    )
    lse_max = tl.max(lse, 0)
    weight_sum = tl.sum(tl.exp2(lse - lse_max), 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < DIM
    merged = tl.zeros([BLOCK_D], dtype=tl.float32)
    for step_start in range(0, written, SPLITS_PER_STEP):
        splits = step_start + tl.arange(0, SPLITS_PER_STEP)
        s_mask = splits < written
        weights = tl.exp2(
            tl.load(partial_lse_ptr + first_split + splits, mask=s_mask, other=-float("inf"))
            - lse_max
        )
        partial = tl.load(
            partial_out_ptr + (first_split + splits)[:, None] * DIM + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        merged += tl.sum(weights[:, None] * partial, 0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
        (merged / weight_sum).to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def merge_splits(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    context_lens: torch.Tensor,
    split_len: int,
    out: torch.Tensor,
    splits_per_step: int,
) -> None:
    """Stage 2: write into `out` [N, H, D] (last dim contiguous) each head's softmax over its
    whole context, merged from the partials of the splits inside `context_lens` int32 [N].

    One program per (sequence, head) sums `splits_per_step` splits' rows at a time, a
    [splits_per_step, D] float32 tile: all of them where that tile fits in registers, fewer for
    wide rows.
    """
    num_seqs, num_heads, num_splits, dim = partial_out.shape
    block_s = triton.next_power_of_2(num_splits)
    _merge_splits_kernel[(num_seqs, num_heads)](
        partial_out,
        partial_lse,
        context_lens,
        out,
        num_heads,
        num_splits,
        split_len,
        out.stride(0),
        out.stride(1),
        DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_S=block_s,
        SPLITS_PER_STEP=min(block_s, triton.next_power_of_2(splits_per_step)),
        num_warps=4,
    )

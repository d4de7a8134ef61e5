"""The online softmax of FlashAttention, as Triton functions the attention kernels call.

A program walks its keys tile by tile and keeps, per query row, the running maximum `m_i` of
its log2-scaled scores, the running sum `l_i` of exp2(score - m_i) and a float32 accumulator of
those weights times the values; each tile rescales what came before by exp2(m_old - m_new).
`acc / l_i` is then the softmax-weighted sum over every key walked, and `m_i + log2(l_i)` its
log-sum-exp (what split-KV decode keeps to merge its splits, see `split_kv`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fold_scores(scores, v, m_i, l_i, acc, dot_dtype: tl.constexpr):
    """Fold one tile's log2-scaled scores [M, N] and values [N, D] into the running max, sum
    and accumulator.

    Masked scores are -inf. A row's first tile must hold a key it sees, so m_i is finite from
    then on; a later tile hiding every key from a row adds p = 0 to it, never NaN.
    """
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), v.to(dot_dtype), input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def fold_key_tile(q, k, v, mask, m_i, l_i, acc, scale_log2, dot_dtype: tl.constexpr):
    """Fold one key tile (k as [D, N], v as [N, D]) into the running softmax of queries q
    [M, D]; `mask` [M, N] (or broadcast to it) hides scores, None where every row sees every key.
    """
    scores = tl.dot(q, k.to(dot_dtype), input_precision="ieee") * scale_log2
    if mask is not None:
        scores = tl.where(mask, scores, float("-inf"))
    return fold_scores(scores, v, m_i, l_i, acc, dot_dtype)

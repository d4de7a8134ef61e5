"""Batch-invariant attention: close to float64, and a query's output keeps its bits whether it
is computed in a cold prefill, a chunked prefill over a cached prefix or a decode, and whatever
else shares the step."""

from __future__ import annotations

import itertools

import pytest
import torch

import kernels as ops
from kernels.invariant_attention import KEY_SPLIT, paged_attention_invariant_torch
from tests.kernels.kernel_checks import ATTENTION_TOLERANCE, reference_attention

# (atol, rtol) against float64. float32: as the default path. bfloat16: the split's scores come
# out of a bf16 matmul rounded to bf16 (2^-9 of |q.k|, which reaches ~30 on these unit-normal
# inputs, ~0.06 before the 1/sqrt(D) scale), and its probabilities are rounded to bf16 for the
# value matmul, as a flash kernel does; ~1e-2 is what we see on outputs of order 1.
TOLERANCE = {torch.float32: ATTENTION_TOLERANCE[torch.float32], torch.bfloat16: (2e-2, 2e-2)}

BLOCK = 16


class Cache:
    """A paged cache with blocks handed out in random order; stale slots hold huge values."""

    def __init__(self, kv_heads, head_dim, dtype, num_blocks=160):
        self.k = torch.full((num_blocks, BLOCK, kv_heads, head_dim), 1e4, dtype=dtype)
        self.v = torch.full_like(self.k, -1e4)
        self.free = torch.randperm(num_blocks).tolist()

    def table(self, length):
        return [self.free.pop() for _ in range(-(-length // BLOCK))]


def _run(cache, sequences, heads, scale):
    """One step: `sequences` is [(q_new, k_all, v_all, table)], decodes (one new token) first.
    Writes the new keys, returns the attention output [T, Hq * D]."""
    kv_heads, head_dim = cache.k.shape[2], cache.k.shape[3]
    queries, keys, values, slot_mapping, tables, query_lens, context_lens = ([] for _ in range(7))
    for q, k_all, v_all, table in sequences:
        ctx, new = k_all.shape[0], q.shape[0]
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)])
        prefix = ctx - new
        cache.k.view(-1, kv_heads, head_dim)[slots[:prefix]] = k_all[:prefix]
        cache.v.view(-1, kv_heads, head_dim)[slots[:prefix]] = v_all[:prefix]
        queries.append(q)
        keys.append(k_all[prefix:])
        values.append(v_all[prefix:])
        slot_mapping.append(slots[prefix:])
        tables.append(table)
        query_lens.append(new)
        context_lens.append(ctx)
    key, value = torch.cat(keys), torch.cat(values)
    ops.store_kvcache(key, value, cache.k, cache.v, torch.cat(slot_mapping))
    batch = ops.build_paged_attention_batch(tables, query_lens, context_lens, BLOCK)
    return paged_attention_invariant_torch(
        torch.cat(queries), key, value, cache.k, cache.v, batch, scale
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 40)])
def test_it_matches_float64_on_a_ragged_batch(dtype, heads, kv_heads, head_dim):
    """Decodes of contexts below, at and past a split; fresh prefills; prefills over a prefix
    that crosses splits."""
    torch.manual_seed(0)
    cache = Cache(kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    shapes = [(1, 1), (1, 17), (1, KEY_SPLIT), (1, 600), (9, 9), (300, 300), (5, 45), (40, 560)]
    sequences, expected = [], []
    for new, ctx in shapes:
        q = torch.randn(new, heads, head_dim, dtype=dtype)
        k_all = torch.randn(ctx, kv_heads, head_dim, dtype=dtype)
        v_all = torch.randn(ctx, kv_heads, head_dim, dtype=dtype)
        sequences.append((q, k_all, v_all, cache.table(ctx)))
        expected.append(reference_attention(q, k_all, v_all, scale))
    out = _run(cache, sequences, heads, scale)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_a_query_keeps_its_bits_in_every_kind_of_step(dtype):
    """One sequence of 700 tokens: its outputs computed in one cold prefill, in chunks over its
    cached prefix (boundaries inside and on splits), and token by token as decodes beside other
    sequences of shorter and longer contexts, are bitwise the same."""
    torch.manual_seed(1)
    heads, kv_heads, head_dim = 9, 3, 64
    scale = head_dim**-0.5
    length = 700
    q = torch.randn(length, heads, head_dim, dtype=dtype)
    k_all = torch.randn(length, kv_heads, head_dim, dtype=dtype)
    v_all = torch.randn(length, kv_heads, head_dim, dtype=dtype)

    cache = Cache(kv_heads, head_dim, dtype)
    table = cache.table(length)
    cold = _run(cache, [(q, k_all, v_all, table)], heads, scale)

    for bounds in ([0, 64, 256, 300, 512, 700], [0, 255, 257, 699, 700]):
        for start, stop in itertools.pairwise(bounds):
            chunk = _run(cache, [(q[start:stop], k_all[:stop], v_all[:stop], table)], heads, scale)
            assert torch.equal(chunk, cold[start:stop]), (bounds, start, stop)

    for position in (0, 1, 255, 256, 257, 511, 600, 699):
        others = []
        for ctx in (3, 300, 900):
            others.append(
                (
                    torch.randn(1, heads, head_dim, dtype=dtype),
                    torch.randn(ctx, kv_heads, head_dim, dtype=dtype),
                    torch.randn(ctx, kv_heads, head_dim, dtype=dtype),
                    cache.table(ctx),
                )
            )
        mine = (q[position : position + 1], k_all[: position + 1], v_all[: position + 1], table)
        for slot in (0, 2, 3):
            batch = others[:slot] + [mine] + others[slot:]
            out = _run(cache, batch, heads, scale)
            row = out[slot : slot + 1]
            assert torch.equal(row, cold[position : position + 1]), (position, slot)
        for _, _, _, other_table in others:
            cache.free.extend(other_table)

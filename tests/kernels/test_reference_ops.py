"""The PyTorch reference ops (the CPU path of every kernel) against float64 math written out
independently, on fresh random inputs each run. Tolerances are stated per dtype."""

from __future__ import annotations

import math

import pytest
import torch

import kernels as ops
from tests.kernels.kernel_checks import reference_attention

# (atol, rtol) by dtype: float32 differs from float64 by rounding only; bfloat16 keeps 8 bits.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tol: dict | None = None
) -> None:
    atol, rtol = (tol or TOL)[dtype]
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dim", [24, 64, 576, 1536])
def test_rms_norm_is_bit_identical_to_the_hugging_face_formula_in_float32(dim):
    x = torch.randn(512, dim) * torch.rand(512, 1) * 10
    weight = torch.randn(dim)
    hf = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    out, _ = ops.rms_norm(x, weight, 1e-5)
    assert torch.equal(out, hf)  # exact: the float32 oracle tests compare greedy tokens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (33, 100)])
def test_rms_norm_matches_float64(dtype, shape):
    x = torch.randn(shape, dtype=dtype)
    weight = torch.randn(shape[-1], dtype=dtype)
    residual = torch.randn(shape, dtype=dtype)
    eps = 1e-6

    def expected(v: torch.Tensor) -> torch.Tensor:
        v = v.double()
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.double()

    out, none = ops.rms_norm(x, weight, eps)
    assert none is None
    close(out, expected(x), dtype)

    out, new_residual = ops.rms_norm(x, weight, eps, residual)
    summed = x + residual  # the residual stream is kept in the model dtype, as HF does
    torch.testing.assert_close(new_residual, summed, atol=0, rtol=0)
    close(out, expected(summed), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (13, 4, 4, 24), (5, 8, 1, 96)]
)
def test_rotary_matches_complex_rotation(dtype, tokens, heads, kv_heads, head_dim):
    base = 10000.0
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    cos, sin = ops.build_cos_sin_cache(inv_freq, 512)
    positions = torch.randint(0, 512, (tokens,))
    q = torch.randn(tokens, heads, head_dim, dtype=dtype)
    k = torch.randn(tokens, kv_heads, head_dim, dtype=dtype)
    q0, k0 = q.clone(), k.clone()
    ops.rotary(q, k, *ops.rotary_cos_sin(cos, sin, positions, dtype))

    def expected(x: torch.Tensor) -> torch.Tensor:
        # NeoX layout: dimension i pairs with i + d/2; rotate each pair by position * inv_freq.
        x = x.double()
        half = head_dim // 2
        pairs = torch.complex(x[..., :half], x[..., half:])
        angle = positions.double()[:, None, None] * inv_freq.double()[None, None, :]
        rotated = pairs * torch.polar(torch.ones_like(angle), angle)
        return torch.cat([rotated.real, rotated.imag], dim=-1)

    # Angles are computed in float32 as Hugging Face does: position × inv_freq is off by up to
    # ~3e-5 rad at position 512, hence 1e-4 for float32.
    tol = {torch.float32: (1e-4, 1e-4), torch.bfloat16: TOL[torch.bfloat16]}
    close(q, expected(q0), dtype, tol)
    close(k, expected(k0), dtype, tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (9, 2 * 37)])
def test_silu_and_mul_matches_float64(dtype, shape):
    x = torch.randn(shape, dtype=dtype)
    gate, up = x.double().chunk(2, dim=-1)
    close(ops.silu_and_mul(x), gate / (1 + torch.exp(-gate)) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 960, 576), (1, 37, 51), (32, 128, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64(dtype, rows, n, k, bias):
    x = torch.randn(rows, k, dtype=dtype)
    weight = torch.randn(n, k, dtype=dtype) / math.sqrt(k)
    b = torch.randn(n, dtype=dtype) if bias else None
    expected = x.double() @ weight.double().T + (b.double() if bias else 0)
    close(ops.linear(x, weight, b), expected, dtype)


@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kvcache_writes_only_mapped_slots(block_size):
    num_blocks, kv_heads, head_dim = 6, 3, 24
    poison = float("nan")
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), poison)
    v_cache = torch.full_like(k_cache, poison)
    slots = torch.tensor([0, block_size + 3, -1, 5 * block_size + block_size - 1])
    key = torch.randn(4, kv_heads, head_dim)
    value = torch.randn(4, kv_heads, head_dim)
    ops.store_kvcache(key, value, k_cache, v_cache, slots)
    k_flat = k_cache.view(-1, kv_heads, head_dim)
    v_flat = v_cache.view(-1, kv_heads, head_dim)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_flat[slot], key[row])
            assert torch.equal(v_flat[slot], value[row])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(k_flat.shape[0]) if s not in written]
    assert torch.isnan(k_flat[untouched]).all() and torch.isnan(v_flat[untouched]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (9, 3, 64), (8, 1, 40)])
def test_paged_attention_matches_float64(dtype, block_size, heads, kv_heads, head_dim):
    """A ragged batch: decodes of various lengths, a fresh prefill, and prefills over a cached
    prefix (chunked prefill / prefix-cache hit); blocks scattered over the cache."""
    decode_contexts = [1, 17, 70]
    prefills = [(9, 0), (5, 40), (20, 33)]  # (new tokens, cached prefix)
    num_blocks = 64
    # Poison: cache slots outside every context hold huge finite values (stale KV is finite),
    # so a read past a sequence's context length shows up in the result.
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), 1e4, dtype=dtype)
    v_cache = torch.full_like(k_cache, -1e4)
    free_blocks = torch.randperm(num_blocks).tolist()
    scale = head_dim**-0.5

    queries, keys, values, slot_mapping = [], [], [], []
    tables, query_lens, context_lens, expected = [], [], [], []
    for new, prefix in [(1, c - 1) for c in decode_contexts] + prefills:
        ctx = new + prefix
        table = [free_blocks.pop() for _ in range(-(-ctx // block_size))]
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        )
        k_all = torch.randn(ctx, kv_heads, head_dim, dtype=dtype)
        v_all = torch.randn(ctx, kv_heads, head_dim, dtype=dtype)
        # The cached prefix is already in the cache; new tokens arrive with the step.
        k_cache.view(-1, kv_heads, head_dim)[slots[:prefix]] = k_all[:prefix]
        v_cache.view(-1, kv_heads, head_dim)[slots[:prefix]] = v_all[:prefix]
        q = torch.randn(new, heads, head_dim, dtype=dtype)
        queries.append(q)
        keys.append(k_all[prefix:])
        values.append(v_all[prefix:])
        slot_mapping.append(slots[prefix:])
        tables.append(table)
        query_lens.append(new)
        context_lens.append(ctx)
        expected.append(reference_attention(q, k_all, v_all, scale))

    query, key, value = torch.cat(queries), torch.cat(keys), torch.cat(values)
    ops.store_kvcache(key, value, k_cache, v_cache, torch.cat(slot_mapping))
    batch = ops.build_paged_attention_batch(tables, query_lens, context_lens, block_size)
    assert batch.num_decode == len(decode_contexts)
    out = ops.attention(query, key, value, k_cache, v_cache, batch, scale)
    close(out, torch.cat(expected), dtype)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("n,k", [(96, 128), (64, 160), (576, 1536), (960, 576)])
def test_int4_linear_matches_float64_of_its_dequantized_weight(rows, n, k):
    """One row runs torch's int4 kernel, several rows the bf16 dequantized copy; both must
    compute x @ dequantize(codes)^T. bf16 activations and outputs: rtol 2e-2, atol 2e-2 * |y|max."""
    from kernels.linear import Int4Weight, int4_dequantize, int4_group_quantize

    weight = torch.randn(n, k) / math.sqrt(k)
    quantized = Int4Weight.quantize(weight)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    codes, _, _ = int4_group_quantize(weight)
    scales = quantized.scales_and_zeros[..., 0].T.double()
    zeros = quantized.scales_and_zeros[..., 1].T.double()
    dequantized = int4_dequantize(codes, scales, zeros, quantized.group_size).double()
    expected = x.double() @ dequantized.T
    out = ops.linear(x, quantized)
    atol = 2e-2 * expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=2e-2)


def test_int4_quantization_error_is_at_most_half_a_step_and_4bit_grids_are_exact():
    from kernels.linear import int4_dequantize, int4_group_quantize

    weight = torch.randn(64, 256)
    codes, scales, zeros = int4_group_quantize(weight)
    assert codes.min() >= 0 and codes.max() <= 15
    error = (int4_dequantize(codes, scales, zeros, 32) - weight).abs().view(64, 8, 32)
    assert (error <= scales[..., None] / 2 + 1e-6).all()
    # A weight that already lies on a 16-level grid per group (as a Q4_1 GGUF's does) comes back
    # with the same codes, and the same values up to float32 rounding.
    grid_codes = torch.randint(0, 16, (64, 256), dtype=torch.int32)
    grid_codes[:, ::32], grid_codes[:, 1::32] = 0, 15  # each group spans its whole grid
    step = torch.rand(64, 8) + 0.1
    low = torch.randn(64, 8)
    on_grid = (grid_codes.view(64, 8, 32) * step[..., None] + low[..., None]).view(64, 256)
    again, scales, zeros = int4_group_quantize(on_grid)
    assert torch.equal(again, grid_codes)
    torch.testing.assert_close(int4_dequantize(again, scales, zeros, 32), on_grid)

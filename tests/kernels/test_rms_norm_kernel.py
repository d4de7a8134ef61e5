"""The Triton RMSNorm (plain and fused with the residual add) against float64 and against its
PyTorch reference, on fresh random inputs each run."""

from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import rms_norm_torch, rms_norm_triton
from tests.kernels.kernel_checks import assert_close_to_float64

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 64), (7, 576), (33, 100), (5, 3, 24), (2, 1531)]


def float64_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_it_matches_float64(dtype, shape):
    x = torch.randn(shape, dtype=dtype) * torch.rand(shape[:-1] + (1,)).to(dtype) * 4
    weight = torch.randn(shape[-1], dtype=dtype)
    out, none = rms_norm_triton(x, weight, 1e-6)
    assert none is None and out.shape == x.shape
    assert_close_to_float64(out, float64_rms_norm(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_fused_residual_add_matches_float64_and_returns_the_new_stream(dtype, shape):
    x, residual = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    weight = torch.randn(shape[-1], dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = rms_norm_triton(x, weight, 1e-5, residual)
    # The stream is rounded to the model dtype after the add, as Hugging Face keeps it: exact.
    assert torch.equal(new_residual, x_before + residual_before)
    assert_close_to_float64(out, float64_rms_norm(x_before + residual_before, weight, 1e-5), dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_it_rounds_where_the_reference_rounds(dtype):
    """The engine's greedy tokens must not depend on the backend: the kernel reproduces the
    reference's roundings. float32 and float16 agree to the bit; bfloat16 to one step of its
    8-bit mantissa (torch's CPU reduction sums in another order)."""
    x, residual = torch.randn(64, 576, dtype=dtype), torch.randn(64, 576, dtype=dtype)
    weight = torch.randn(576, dtype=dtype)
    ours, our_stream = rms_norm_triton(x, weight, 1e-5, residual)
    theirs, their_stream = rms_norm_torch(x, weight, 1e-5, residual)
    assert torch.equal(our_stream, their_stream)
    step = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(ours, theirs, atol=step * 4, rtol=step)

"""The Triton gated activations (SwiGLU, GeGLU exact and tanh) against float64."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.activation import gelu_and_mul_triton, silu_and_mul_triton
from tests.kernels.kernel_checks import assert_close_to_float64

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 2 * 1536), (9, 2 * 37), (3, 4, 2 * 96), (2, 2 * 1500)]


def float64_gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_silu_and_mul_matches_float64(dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 3
    gate, up = x.double().chunk(2, dim=-1)
    out = silu_and_mul_triton(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert_close_to_float64(out, gate / (1 + torch.exp(-gate)) * up, dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gelu_and_mul_matches_float64(approximate, dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 3
    gate, up = x.double().chunk(2, dim=-1)
    out = gelu_and_mul_triton(x, approximate)
    assert_close_to_float64(out, float64_gelu(gate, approximate) * up, dtype)


def test_the_exact_and_tanh_gelus_differ():
    """Guards the test above: had the kernel ignored `approximate`, one of the two would fail
    (they differ by up to ~1e-3 here, 100× the float32 tolerance)."""
    x = torch.linspace(-4, 4, 2 * 512).view(1, -1)
    exact, tanh = gelu_and_mul_triton(x, "none"), gelu_and_mul_triton(x, "tanh")
    assert (exact - tanh).abs().max() > 1e-4

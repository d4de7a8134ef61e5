"""What the Triton kernel tests share: tolerances per dtype and the float64 comparison.

Every kernel test runs under Triton's interpreter on the CPU; the root conftest sets
`TRITON_INTERPRET=1` before anything imports `kernels`.
"""

from __future__ import annotations

import torch

# (atol, rtol) against a float64 reference. float32 differs by rounding only. bfloat16 keeps 8
# bits of mantissa (relative step 2^-8 = 3.9e-3), and an op rounds its inputs, an intermediate
# and its output: 2e-2 covers a few roundings on values of order 1. float16 keeps 11 bits.
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


def assert_close_to_float64(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    tolerance: dict[torch.dtype, tuple[float, float]] | None = None,
) -> None:
    """`actual` (computed in `dtype`) against the float64 `expected`, at `dtype`'s tolerance."""
    atol, rtol = (tolerance or TOLERANCE)[dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer of NaN: an element a kernel forgets to write fails every comparison."""
    return torch.full(shape, float("nan"), dtype=dtype)

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


# Attention (decode and extend), (atol, rtol) against float64 on the same low-precision inputs, so
# the only errors are float32 accumulation (~1e-6 here) and the final rounding of the output to
# its dtype:
# - float32: no output rounding beyond float32's own; 2e-5 leaves ~20x margin over what we see.
# - bfloat16: 8 significant bits; the interpreter truncates float32 -> bfloat16 instead of
#   rounding (up to 1 ulp, 2^-7 relative), hence rtol 1e-2; atol for outputs near zero.
# - float16: 11 significant bits, correctly rounded: half an ulp is 2^-11 relative.
ATTENTION_TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (1e-3, 1e-2),
    torch.float16: (1e-4, 1e-3),
}


def check_attention(actual, expected, dtype, shape_id: str) -> None:
    """An attention output against its float64 expectation at ATTENTION_TOLERANCE."""
    atol, rtol = ATTENTION_TOLERANCE[dtype]
    torch.testing.assert_close(
        actual.double(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{shape_id}: {m}"
    )


def reference_attention(q, k, v, scale):
    """float64 causal attention of q [n_new, H, D] over k/v [ctx, Hk, D]; new tokens last."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    n_new, ctx = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = torch.arange(ctx)[None, :] <= torch.arange(n_new)[:, None] + (ctx - n_new)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n_new, -1)

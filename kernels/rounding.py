"""Rounding to a storage dtype inside Triton kernels, the same on a GPU and in the interpreter.

Triton's interpreter converts float32 to bfloat16 by truncation (it drops the low 16 bits), while
a GPU and PyTorch round to nearest even. Kernels that must give the reference's bits (the engine's
greedy tokens must not depend on the backend) round with `round_to` instead of `.to(dtype)`: the
bit arithmetic rounds to nearest even, after which the conversion is exact on every backend. It
costs a few integer ops per element in kernels bound by memory traffic.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """`x` (float32) converted to `dtype`, rounded to nearest even."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)

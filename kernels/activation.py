"""Gated MLP activations: the input holds [gate | up] along its last dimension.

`silu_and_mul` is SwiGLU (Llama, Mistral, Qwen); `gelu_and_mul` is GeGLU (Gemma), with exact
(erf) GELU or its tanh approximation. The Triton kernels read the two halves once and write the
product once: one memory-bound pass instead of three.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.batch_invariance import silu
from kernels.rounding import round_to

# Triton kernels take the activation as a constexpr code (0 is left for "none").
ACTIVATIONS = {"silu": 1, "gelu": 2, "gelu_tanh": 3}


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, where x = [gate | up]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def silu_and_mul_invariant(x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul_torch` for batch-invariant mode: the SiLU from exp
    (`kernels.batch_invariance.silu`), whose bits do not depend on where an element lies."""
    gate, up = x.chunk(2, dim=-1)
    return silu(gate).mul_(up)


def gelu_and_mul_torch(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeGLU: gelu(gate) * up, where x = [gate | up]; `approximate` is "none" (erf) or "tanh"."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate).mul_(up)


@triton.jit
def activate(g, ACTIVATION: tl.constexpr):
    """silu, gelu (erf) or gelu (tanh) of the float32 tile `g`, by its ACTIVATIONS code; shared by
    the gated-MLP kernels here and the fused MoE's GEMM epilogue."""
    if ACTIVATION == 1:
        act = g / (1.0 + tl.exp(-g))
    elif ACTIVATION == 2:
        act = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        # tanh from exp, which every backend (and the interpreter) has; on |z| so that exp never
        # overflows.
        decay = tl.exp(-2.0 * tl.abs(inner))
        tanh = (1.0 - decay) / (1.0 + decay)
        tanh = tl.where(inner < 0, -tanh, tanh)
        act = 0.5 * g * (1.0 + tanh)
    return act


@triton.jit
def _gated_kernel(
    x_ptr,
    out_ptr,
    width,
    ACTIVATION: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * 2 * width + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * width + width + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    act = activate(gate.to(tl.float32), ACTIVATION)
    # The activation is rounded to the input dtype before the product, as the reference's is.
    out = round_to(act, dtype).to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * width + cols, round_to(out, dtype), mask=mask)


def _gated_triton(x: torch.Tensor, activation: str) -> torch.Tensor:
    width = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * width).contiguous()
    out = torch.empty((rows.shape[0], width), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(width), 1024)
    grid = (rows.shape[0], triton.cdiv(width, block))
    if rows.shape[0]:
        _gated_kernel[grid](rows, out, width, ACTIVATION=ACTIVATIONS[activation], BLOCK=block)
    return out.view(*x.shape[:-1], width)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton SwiGLU with the same contract as `silu_and_mul_torch`."""
    return _gated_triton(x, "silu")


def gelu_and_mul_triton(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Triton GeGLU with the same contract as `gelu_and_mul_torch`."""
    return _gated_triton(x, "gelu" if approximate == "none" else "gelu_tanh")

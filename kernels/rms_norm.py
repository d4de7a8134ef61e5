"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder.

The Triton kernel reads each row once, adds the residual, writes the new residual stream and the
normalised row in the same pass: a decoder layer's two norms become two memory-bound passes
instead of four. It rounds where the reference rounds (the sum to the input dtype, the normalised
row to the input dtype before the weight), so both paths produce the same tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rounding import round_to


def rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dimension, computed in float32 as Hugging Face Llama does.

    With `residual`, first computes `x = x + residual` (in x's dtype) and returns
    `(rms_norm(x), x)` so the caller keeps the new residual stream; otherwise `(rms_norm(x), None)`.
    """
    if residual is not None:
        x = x + residual
        residual = x
    # Written out as Hugging Face does (bit-identical in float32, checked in tests). torch's
    # F.rms_norm gives the same bits and was not reliably faster (docs/performance.md).
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = (x32 * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed, residual


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * n_cols + cols, mask=mask, other=0.0)
        # The sum is rounded to the input dtype, as the reference's `x + residual` is.
        x = round_to(x.to(tl.float32) + residual.to(tl.float32), x.dtype)
        tl.store(residual_out_ptr + row * n_cols + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / n_cols
    normed = round_to(x32 * tl.math.rsqrt(variance + eps), x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, round_to(out, out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton RMSNorm with the same contract as `rms_norm_torch`."""
    n_cols = x.shape[-1]
    rows = x.reshape(-1, n_cols).contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    residual_out = None
    if residual is not None:
        residual_rows = residual.reshape(-1, n_cols).contiguous()
        residual_out = torch.empty_like(rows)
    block = triton.next_power_of_2(n_cols)
    # One row per program: hidden sizes fit one block, and a warp per 256 columns keeps each
    # thread's share of the row in registers on a GPU.
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        residual_rows if residual is not None else rows,
        weight,
        out,
        residual_out if residual is not None else out,
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
    )
    out = out.view(x.shape)
    return out, (residual_out.view(x.shape) if residual_out is not None else None)

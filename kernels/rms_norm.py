"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder."""

from __future__ import annotations

import torch


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
    # F.rms_norm gives the same bits but took 1.7x as long on 2,281 rows here.
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = (x32 * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed, residual

"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    # torch's fused rms_norm computes x * rsqrt(mean(x²) + eps) exactly as HF writes it out
    # (bit-identical in float32, checked in tests), in one op instead of five.
    normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps).to(x.dtype)
    return weight * normed, residual

"""Dense projection y = x W^T + b.

One-row bfloat16 inputs (a single decoding sequence) go through `torch.mv`: on this CPU class
oneDNN's GEMM path reads the weight at about half the bandwidth `mv` reaches (measured in
`bench/engine.py` notes, docs/performance.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] @ weight[N, K]^T (+ bias[N]) -> [T, N]."""
    if x.shape[0] == 1 and x.dtype == torch.bfloat16 and not x.is_cuda:
        out = torch.mv(weight, x[0]).unsqueeze(0)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)

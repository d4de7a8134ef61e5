"""Dense projection y = x W^T + b, and the weight layout it runs fastest from.

On the CPU, a bfloat16 weight is reordered once into oneDNN's blocked layout
(`pack_linear_weight`): an unpacked bf16 weight is reordered again on every call, which costs more
than the product itself at decode batch sizes (measured in docs/performance.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Batch size oneDNN tunes the packed layout for; any batch size runs with it.
_PACK_BATCH_HINT = 32


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """The layout `linear` should be given `weight` in: packed for bf16 on a oneDNN CPU."""
    if (
        weight.dtype == torch.bfloat16
        and not weight.is_cuda
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_BATCH_HINT)
    return weight


def linear_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] @ weight[N, K]^T (+ bias[N]) -> [T, N]; `weight` plain or packed."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)

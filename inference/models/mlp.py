"""The dense gated MLP (SwiGLU) of every family: gate and up fused into one projection."""

from __future__ import annotations

import torch

import kernels as ops
from inference.models.checkpoint import Checkpoint


class DenseMLP:
    """down(silu(gate · x) * (up · x)), with [gate | up] one weight [2I, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        self.gate_up_proj = torch.empty(2 * intermediate_size, hidden_size, dtype=dtype)
        self.down_proj = torch.empty(hidden_size, intermediate_size, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops.linear(ops.silu_and_mul(ops.linear(hidden, self.gate_up_proj)), self.down_proj)

    def load(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Copy `prefix{gate,up,down}_proj.weight`, fusing gate and up."""
        gate, up = (
            checkpoint.take(prefix + "gate_proj.weight"),
            checkpoint.take(prefix + "up_proj.weight"),
        )
        self.gate_up_proj.copy_(torch.cat([gate, up], dim=0))
        self.down_proj.copy_(checkpoint.take(prefix + "down_proj.weight"))

    def pack(self, quantization: str | None) -> None:
        for name in ("gate_up_proj", "down_proj"):
            setattr(self, name, pack_projection(getattr(self, name), quantization))


def pack_projection(weight: torch.Tensor, quantization: str | None):
    """A projection in the layout `ops.linear` runs fastest from: int4 when asked, else packed."""
    if quantization == "int4":
        return ops.Int4Weight.quantize(weight)
    return ops.pack_linear_weight(weight)

"""The dense gated MLP (SwiGLU) of every family: gate and up fused into one projection.

Across a group of ranks it is split by its intermediate size (`Parallel.share`): a rank holds the
gate and up rows of its share and the same columns of down, so its output is a partial sum that
one all-reduce completes (`forward`); a MoE's shared expert hands its partial sum to the layer's
own all-reduce instead (`partial_forward`).
"""

from __future__ import annotations

import torch

import kernels as ops
from inference.distributed.parallel import Parallel
from inference.distributed.sharding import Slices
from inference.models.checkpoint import Checkpoint


class DenseMLP:
    """down(silu(gate · x) * (up · x)), with [gate | up] one weight [2I, H] (I: this rank's
    share of the intermediate size)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        parallel: Parallel,
    ) -> None:
        self.parallel = parallel
        self.share = parallel.share(intermediate_size, "intermediate size")
        local = self.share[1] - self.share[0]
        self.gate_up_proj = torch.empty(2 * local, hidden_size, dtype=dtype)
        self.down_proj = torch.empty(hidden_size, local, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self.partial_forward(hidden))

    def partial_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce."""
        return ops.linear(ops.silu_and_mul(ops.linear(hidden, self.gate_up_proj)), self.down_proj)

    def load(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Read `prefix{gate,up,down}_proj.weight` (this rank's rows of gate and up, its columns
        of down), fusing gate and up."""
        rows, columns = Slices.of(0, self.share), Slices.of(1, self.share)
        gate = checkpoint.take(prefix + "gate_proj.weight", part=rows)
        up = checkpoint.take(prefix + "up_proj.weight", part=rows)
        self.gate_up_proj.copy_(torch.cat([gate, up], dim=0))
        self.down_proj.copy_(checkpoint.take(prefix + "down_proj.weight", part=columns))

    def pack(self, quantization: str | None) -> None:
        for name in ("gate_up_proj", "down_proj"):
            setattr(self, name, pack_projection(getattr(self, name), quantization))


def pack_projection(weight: torch.Tensor, quantization: str | None):
    """A projection in the layout `ops.linear` runs fastest from: int4 when asked, else packed."""
    if quantization == "int4":
        return ops.Int4Weight.quantize(weight)
    return ops.pack_linear_weight(weight)

"""Gated MLP activations: the input holds [gate | up] along its last dimension."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, where x = [gate | up]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)

"""Choose the implementation of each op for the tensors it is given.

Every op in `kernels` exists as a PyTorch reference (fast on the CPU, the oracle for the GPU
kernels). CUDA tensors go to the Triton kernel of an op when one is registered; CPU tensors go to
the reference. `HEARTH_KERNELS=triton` forces the Triton path on the CPU (run under
`TRITON_INTERPRET=1`); `HEARTH_KERNELS=torch` forces the reference everywhere. The variable is
read once, at import (like `TRITON_INTERPRET`): ops run thousands of times per second.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

_TRITON_OPS: dict[str, Callable] = {}


def register_triton(op_name: str, fn: Callable) -> None:
    """Register the Triton implementation of `op_name` (called by the Triton kernel modules)."""
    _TRITON_OPS[op_name] = fn


def _forced_backend_from_env() -> str | None:
    value = os.environ.get("HEARTH_KERNELS", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("torch", "triton"):
        raise ValueError(f"HEARTH_KERNELS must be 'torch', 'triton' or 'auto', got {value!r}")
    return value


_forced_backend = _forced_backend_from_env()


def forced_backend() -> str | None:
    """The backend named by HEARTH_KERNELS ('torch' or 'triton'), or None for automatic."""
    return _forced_backend


def select(op_name: str, reference: Callable, tensor: torch.Tensor) -> Callable:
    """Return the implementation of `op_name` to run on `tensor`."""
    backend = _forced_backend
    if backend is None and not tensor.is_cuda:
        return reference
    if backend == "torch":
        return reference
    triton_fn = _TRITON_OPS.get(op_name)
    if backend == "triton":
        if triton_fn is None:
            raise NotImplementedError(
                f"HEARTH_KERNELS=triton but op {op_name!r} has no Triton kernel yet"
            )
        return triton_fn
    if tensor.is_cuda and triton_fn is not None:
        return triton_fn
    return reference

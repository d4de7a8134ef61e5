"""Choose the implementation of each op for the tensors it is given.

Every op in `kernels` exists as a PyTorch reference (fast on the CPU, the oracle for the GPU
kernels) and, except `linear`, as a Triton kernel with the same signature. CUDA tensors go to the
Triton kernel; CPU tensors go to the reference. `HEARTH_KERNELS=triton` forces the Triton path on
the CPU too, which needs Triton's interpreter: `TRITON_INTERPRET=1` must be in the environment
before `kernels` is first imported (Triton reads it when the kernels are defined), so this module
sets it then when no GPU is present. `HEARTH_KERNELS=torch` forces the reference everywhere. The
variable is read once, at import: ops run thousands of times per second.

In batch-invariant mode (`kernels.batch_invariance`) an op with an `invariant` path runs it on CPU
tensors, whatever HEARTH_KERNELS says: the Triton kernels have no batch-invariant variants yet.

`linear` has no Triton kernel on purpose: a dense projection is cuBLAS's job on a GPU (and
torch's int4 kernel's for quantized weights); it runs its reference under every setting.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.batch_invariance import is_batch_invariant

# Ops whose reference is also what a GPU should run (see the module docstring).
TORCH_ONLY_OPS = frozenset({"linear"})


@dataclass(frozen=True)
class Op:
    """One op's two implementations, which share a signature."""

    name: str
    reference: Callable
    triton: Callable | None = None
    # The CPU path of batch-invariant mode (kernels.batch_invariance), where the reference's
    # summation order depends on the step's shape.
    invariant: Callable | None = None

    def __post_init__(self) -> None:
        # Only the ops that are torch's by design may lack a kernel, so `select` never has to
        # find one missing at run time.
        if self.triton is None and self.name not in TORCH_ONLY_OPS:
            raise ValueError(f"op {self.name!r} needs a Triton kernel")


def _forced_backend_from_env() -> str | None:
    value = os.environ.get("HEARTH_KERNELS", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("torch", "triton"):
        raise ValueError(f"HEARTH_KERNELS must be 'torch', 'triton' or 'auto', got {value!r}")
    return value


_forced_backend = _forced_backend_from_env()
if _forced_backend == "triton" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def forced_backend() -> str | None:
    """The backend named by HEARTH_KERNELS ('torch' or 'triton'), or None for automatic."""
    return _forced_backend


def select(op: Op, tensor: torch.Tensor) -> Callable:
    """Return the implementation of `op` to run on `tensor`."""
    if op.invariant is not None and not tensor.is_cuda and is_batch_invariant():
        return op.invariant
    backend = _forced_backend
    if backend == "torch" or op.triton is None:
        return op.reference
    if backend == "triton" or tensor.is_cuda:
        return op.triton
    return op.reference

"""Float32 batched matmuls whose every output element is summed in one fixed order.

torch's float32 matmuls on the CPU go to the BLAS (MKL), which picks a kernel by the call's
shape, its batch count and the thread count: a row of the scores comes out with other bits when
the step holds more rows, more sequences or runs on another number of threads (measured on an
AVX2 EPYC: every shape probed differed somewhere). Batch-invariant attention needs a row's
result to depend on that row alone, so in float32 it multiplies with these two kernels instead
(`kernels/csrc/fixed_order_matmul.cpp`):

- `dot_nt(left [B, M, K], right [B, N, K])` = left @ right^T (scores against keys): each output
  sums its K products in 8 interleaved lanes, then the lanes, then the remainder, always alike;
- `dot_nn(left [B, M, K], right [B, K, N])` = left @ right (probabilities times values): each
  output sums over K in order.

Threads split the rows; a row is computed by one thread, so the thread count changes nothing.

The extension is compiled on first use with torch's C++ extension builder (about a minute; the
build is cached under torch's extensions directory, and `make setup` runs it once), for the CPU
at hand: with AVX2 and FMA where the CPU has them. `available()` says whether it could be built;
where it can't (no compiler), float32 deterministic mode is refused with the reason.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

import torch

_SOURCE = Path(__file__).parent / "csrc" / "fixed_order_matmul.cpp"
# Compiled code is part of what decides the numbers: the flags follow the CPU's capability
# (which the system fingerprint names), never `-march=native`.
_FLAGS = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx2", "-mfma"]}


class NativeBuildError(RuntimeError):
    """The fixed-order matmul extension could not be compiled or loaded here."""


@functools.cache
def _module():
    from torch.utils.cpp_extension import load

    # torch's builder runs `ninja` from PATH; the one pip installed sits beside this interpreter.
    beside = Path(sys.executable).parent
    if shutil.which("ninja") is None and (beside / "ninja").exists():
        os.environ["PATH"] = os.pathsep.join([str(beside), *os.get_exec_path()])
    capability = torch.backends.cpu.get_cpu_capability()
    # No fused multiply-add contraction: every code path the compiler makes (vector body,
    # scalar remainder) then multiplies and adds with the same two roundings.
    flags = ["-O3", "-ffp-contract=off", *_FLAGS.get(capability, [])]
    try:
        return load(
            name=f"hearth_fixed_order_matmul_{capability.lower()}",
            sources=[str(_SOURCE)],
            extra_cflags=flags,
            verbose=False,
        )
    except Exception as error:  # a missing compiler or header, reported with its message
        raise NativeBuildError(f"could not build {_SOURCE.name}: {error}") from error


def available() -> str | None:
    """None when the kernels are built and loaded, else why not."""
    try:
        _module()
    except NativeBuildError as error:
        return str(error)
    return None


def dot_nt(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left [B, M, K] @ right [B, N, K]^T -> [B, M, N], float32, fixed order per element."""
    return _module().dot_nt(left.contiguous(), right.contiguous())


def dot_nn(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left [B, M, K] @ right [B, K, N] -> [B, M, N], float32, fixed order per element."""
    return _module().dot_nn(left.contiguous(), right.contiguous())

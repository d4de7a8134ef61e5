"""What this machine can do, measured in the benchmark's own run: the limits its figures are
read against (the gpt-fast way: a decode step cannot be faster than reading the weights once).

For each dtype the engine may run in (bfloat16, float32):
- `gemv_gb_s`: the rate at which a one-row matmul (`x @ W.T`, what a decode step of one sequence
  does with every projection) streams a weight matrix too large for the caches, in GB/s of
  weights; the best of a few repetitions, with torch's threads as the engine runs them;
- `gflops`: a 256 x 2048 x 2048 matmul's rate (what prefill and large batches are bound by).
And `read_gb_s`: a plain float32 sum over the same bytes, the memory system's rate without a
matmul's arithmetic.

`ceiling_tok_s(concurrency, ...)` turns them into the most tokens per second a decode step of
that many sequences can give in one dtype: each step reads the weights once (bandwidth) and does
two floating-point operations per parameter and sequence (compute); the slower of the two bounds
it. Attention's reads of the KV cache and everything else the step does only lower it further.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

WEIGHT_BYTES = 512 * 2**20  # larger than any cache of a CPU this runs on
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Limits:
    gemv_gb_s: dict[str, float]  # by dtype name
    gflops: dict[str, float]
    read_gb_s: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_limits(repeats: int = 3) -> Limits:
    gemv, gflops, read_gb_s = {}, {}, 0.0
    columns = 4096
    with torch.inference_mode():
        for name, dtype in DTYPES.items():
            size = dtype.itemsize
            weight = torch.randn(WEIGHT_BYTES // (size * columns), columns).to(dtype)
            vector = torch.randn(1, columns).to(dtype)
            seconds = best_seconds(
                lambda w=weight, v=vector: torch.nn.functional.linear(v, w), repeats
            )
            gemv[name] = weight.numel() * size / seconds / 1e9
            if dtype is torch.float32:
                read_gb_s = weight.numel() * size / best_seconds(weight.sum, repeats) / 1e9
            del weight
            a = torch.randn(256, 2048).to(dtype)
            b = torch.randn(2048, 2048).to(dtype)
            seconds = best_seconds(lambda a=a, b=b: a @ b, 1)
            gflops[name] = 2 * 256 * 2048 * 2048 / seconds / 1e9
    return Limits(gemv, gflops, read_gb_s)


def ceiling_tok_s(
    concurrency: int, weight_bytes: int, parameters: int, gb_s: float, gflops: float
) -> float:
    """Decode tokens per second for `concurrency` sequences a step, bound by reading
    `weight_bytes` once a step at `gb_s` and by 2 × `parameters` × sequences operations a step
    at `gflops`."""
    read_s = weight_bytes / (gb_s * 1e9)
    compute_s = 2 * parameters * concurrency / (gflops * 1e9)
    return concurrency / max(read_s, compute_s)

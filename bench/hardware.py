"""What this machine can do, measured in the benchmark's own run: the limits its figures are
read against (the gpt-fast way: a decode step cannot be faster than reading the weights once).

- `weight_read_gb_s`: the rate at which a one-row bf16 matmul (`x @ W.T`, what a decode step of
  one sequence does with every projection) streams a weight matrix too large for the caches;
  the best of a few repetitions, with torch's threads as the engine runs them.
- `read_gb_s`: a plain read of the same bytes (a sum), for comparison: the memory system's rate
  without the matmul's arithmetic.
- `bf16_gflops` / `fp32_gflops`: a square matmul's rate in each dtype (what prefill and large
  batches are bound by).

`ceiling_tok_s(concurrency, ...)` turns them into the most tokens per second a decode step of
that many sequences can give: each step reads the weights once (bandwidth) and does two
floating-point operations per parameter and sequence (compute); the slower of the two bounds it.
Attention's reads of the KV cache and everything else the step does only lower it further.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

WEIGHT_BYTES = 512 * 2**20  # larger than any cache of a CPU this runs on


@dataclass(frozen=True)
class Limits:
    weight_read_gb_s: float
    read_gb_s: float
    bf16_gflops: float
    fp32_gflops: float

    def as_dict(self) -> dict[str, float]:
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


def measure_limits(repeats: int = 5) -> Limits:
    weight_read, read = _read_rates(repeats)
    gflops = {}
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            a = torch.randn(1024, 2048).to(dtype)
            b = torch.randn(2048, 2048).to(dtype)
            seconds = best_seconds(lambda a=a, b=b: a @ b, repeats)
            gflops[dtype] = 2 * 1024 * 2048 * 2048 / seconds / 1e9
    return Limits(
        weight_read_gb_s=weight_read,
        read_gb_s=read,
        bf16_gflops=gflops[torch.bfloat16],
        fp32_gflops=gflops[torch.float32],
    )


def _read_rates(repeats: int) -> tuple[float, float]:
    """GB/s of a one-row bf16 matmul over WEIGHT_BYTES of weights, and of a plain sum."""
    columns = 4096
    weight = torch.randn(WEIGHT_BYTES // (2 * columns), columns).to(torch.bfloat16)
    vector = torch.randn(1, columns).to(torch.bfloat16)
    nbytes = weight.numel() * 2
    with torch.inference_mode():
        gemv = best_seconds(lambda: torch.nn.functional.linear(vector, weight), repeats)
        read = best_seconds(lambda: weight.sum(dtype=torch.float32), repeats)
    return nbytes / gemv / 1e9, nbytes / read / 1e9


def ceiling_tok_s(
    concurrency: int, weight_bytes: int, parameters: int, gb_s: float, gflops: float
) -> float:
    """Decode tokens per second for `concurrency` sequences a step, bound by reading
    `weight_bytes` once a step at `gb_s` and by 2 × `parameters` × sequences operations a step
    at `gflops`."""
    read_s = weight_bytes / (gb_s * 1e9)
    compute_s = 2 * parameters * concurrency / (gflops * 1e9)
    return concurrency / max(read_s, compute_s)

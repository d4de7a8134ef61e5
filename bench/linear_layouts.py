"""The engine's projections in each weight layout torch offers on the CPU, timed in one run:
torch's BLAS on the plain weight (what the engine ran float32 with before), oneDNN on the packed
weight (`kernels.linear.pack_linear_weight`, now every dtype's default), and torch's int8
weight-only kernel (a candidate for one-row steps). SmolLM2-135M's shapes (q|k|v, o, gate|up,
down per layer, 30 layers, and the LM head), random weights, `--dtype` (float32 by default), for
each row count; each figure is the median of `--repeats` timings.

It prints a table per row count and, as its last line, one JSON object (also written to
bench/results/linear-layouts.json): per row count and layout, the milliseconds of one step's
projections and the largest error against float64.

    .venv/bin/python bench/linear_layouts.py
    .venv/bin/python bench/linear_layouts.py --rows 1 32 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.engine import RESULTS_DIR, log, write_json  # noqa: E402
from kernels.linear import pack_linear_weight_for_onednn  # noqa: E402

LAYERS = 30
# (out_features, in_features) of SmolLM2-135M's projections; the LM head runs once a step.
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def median_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def layouts(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Each layout's call for x @ weight^T."""
    packed = pack_linear_weight_for_onednn(weight)
    scales = weight.float().abs().amax(1) / 127
    codes = (weight.float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    calls = {"blas_plain": lambda: F.linear(x, weight)}
    if packed is not None:
        calls["onednn_packed"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], ""
        )
    calls["int8_weight_only"] = lambda: torch._weight_int8pack_mm(x, codes, scales.to(x.dtype))
    return calls


def measure(rows: int, dtype: torch.dtype, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(rows)
    step_ms: dict[str, float] = {}
    errors: dict[str, float] = {}
    for name, (out_features, in_features) in SHAPES.items():
        weight = (torch.randn(out_features, in_features, generator=generator) / 24).to(dtype)
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        reference = F.linear(x.double(), weight.double())
        per_step = 1 if name == "lm_head" else LAYERS
        for layout, call in layouts(weight, x).items():
            # The int8 kernel is slow at many rows; fewer repeats keep the run short.
            count = max(3, repeats // 10) if layout == "int8_weight_only" and rows > 1 else repeats
            step_ms[layout] = step_ms.get(layout, 0.0) + median_ms(call, count) * per_step
            error = (call().double() - reference).abs().max().item()
            errors[layout] = max(errors.get(layout, 0.0), error)
    return {"rows": rows, "step_ms": step_ms, "max_abs_error": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    capability = torch.backends.cpu.get_cpu_capability()
    log(f"{torch.get_num_threads()} threads, CPU capability {capability}")
    results = []
    for rows in args.rows:
        result = measure(rows, dtype, args.repeats)
        results.append(result)
        base = result["step_ms"]["blas_plain"]
        print(f"\n{rows} row(s), {args.dtype}: one step's projections ({LAYERS} layers + LM head)")
        print(f"{'layout':<18} {'ms':>9} {'vs BLAS':>8} {'max error':>10}")
        for layout, ms in result["step_ms"].items():
            error = result["max_abs_error"][layout]
            print(f"{layout:<18} {ms:>9.1f} {ms / base:>7.2f}x {error:>10.1e}")
    summary = {
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "results": results,
    }
    write_json(summary, RESULTS_DIR / "linear-layouts.json")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""bench/kernels.py measures on a GPU; its `--smoke` mode runs every kernel once at tiny sizes
on the CPU, so the script is known to work before a GPU run is spent on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "gelu_and_mul",
    "rotary",
    "store_kvcache",
    "decode_attention",
    "extend_attention",
    "mla_decode",
    "fused_moe",
}


def test_the_kernel_benchmark_runs_every_kernel_in_smoke_mode():
    result = subprocess.run(
        [sys.executable, "bench/kernels.py", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert {row["kernel"] for row in summary["kernels"]} == KERNELS
    assert summary["copy_gb_s"] > 0 and summary["matmul_tflop_s"] > 0
    assert all(row["ms"] > 0 and row["reference_ms"] for row in summary["kernels"])

"""The dtype a CPU engine runs in when none is asked for (`EngineConfig(dtype="auto")`).

bfloat16 halves the bytes every decode step reads, which is what bounds decoding, but only a CPU
that multiplies bf16 natively (AVX-512 BF16, or AMX) gains from it: elsewhere oneDNN converts
every bf16 operand to float32 first. Measured on an AVX2-only EPYC (2026-12-07, SmolLM2-135M,
docs/performance.md): an 800-token prefill took 12.9 s in bf16 against 2.4 s in float32, and 32
sequences decoded 2.5 times as fast in float32. On the AMX machine of issue 2, bf16 GEMM ran
at 535-593 GFLOP/s against float32's 154. So "auto" is bfloat16 where the CPU reports one of
those features, float32 otherwise.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags() -> frozenset[str]:
    """The feature flags /proc/cpuinfo reports for this CPU (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@cache
def preferred_dtype() -> str:
    """bfloat16 where the CPU multiplies bf16 natively, else float32."""
    return "bfloat16" if cpu_flags() & NATIVE_BF16 else "float32"

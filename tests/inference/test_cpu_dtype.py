"""`dtype="auto"` (inference/engine/cpu_dtype.py): bfloat16 only where this CPU multiplies bf16
natively, float32 elsewhere; int4 weights keep bfloat16; an explicit dtype is kept."""

from __future__ import annotations

from inference.engine import EngineConfig
from inference.engine.cpu_dtype import NATIVE_BF16, cpu_flags


def test_auto_follows_the_cpus_bf16_support():
    flags = cpu_flags()
    assert "fpu" in flags  # /proc/cpuinfo was read
    expected = "bfloat16" if flags & NATIVE_BF16 else "float32"
    assert EngineConfig().dtype == expected
    assert EngineConfig(dtype="auto").torch_dtype == EngineConfig(dtype=expected).torch_dtype


def test_int4_and_explicit_dtypes_are_kept():
    assert EngineConfig(quantization="int4").dtype == "bfloat16"
    assert EngineConfig(dtype="float32").dtype == "float32"
    assert EngineConfig(dtype="bf16").dtype == "bf16"

"""`system_fingerprint`: stable for one configuration, different when anything that decides the
numbers changes."""

from __future__ import annotations

import shutil

from inference.engine import EngineConfig
from inference.engine.fingerprint import system_fingerprint


def _fingerprint(directory, **options) -> str:
    return system_fingerprint(EngineConfig(model=str(directory), **options), directory)


def test_it_is_stable_for_one_configuration(tiny_llama_dir):
    first = _fingerprint(tiny_llama_dir, dtype="bfloat16")
    assert first == _fingerprint(tiny_llama_dir, dtype="bfloat16")
    assert first.startswith("fp_") and len(first) == 15


def test_it_changes_with_dtype_mode_and_quantization(tiny_llama_dir):
    seen = {
        _fingerprint(tiny_llama_dir, dtype="bfloat16"),
        _fingerprint(tiny_llama_dir, dtype="float32"),
        _fingerprint(tiny_llama_dir, dtype="bfloat16", deterministic=True),
        _fingerprint(tiny_llama_dir, dtype="bfloat16", quantization="int4"),
    }
    assert len(seen) == 4


def test_it_changes_with_the_weights(tiny_llama_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    # The same model under the same name: only the weights decide.
    same = system_fingerprint(EngineConfig(model="m", dtype="bfloat16"), copy)
    assert same == system_fingerprint(EngineConfig(model="m", dtype="bfloat16"), tiny_llama_dir)
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor
    weights.write_bytes(bytes(data))
    assert system_fingerprint(EngineConfig(model="m", dtype="bfloat16"), copy) != same

"""Quantized checkpoints load dequantized to the engine's dtype and give transformers' greedy
tokens on the very weights the engine sees: DeepSeek-V3's block-wise FP8 (every projection) and
Kimi K2.5's compressed-tensors INT4 routed experts, on tiny DeepSeek-V3 models."""

from __future__ import annotations

import pytest

from inference.engine import LLM, SamplingParams
from tests.inference.conftest import hf_greedy
from tests.inference.quantized_checkpoints import (
    dequantized_copy,
    write_fp8_checkpoint,
    write_int4_experts_checkpoint,
)
from tests.inference.tiny_models import build_tiny_model

PROMPTS = [[5, 9, 17, 40, 41, 3], list(range(3, 40)), [7] * 20]


@pytest.mark.parametrize(
    "architecture, quantize",
    [
        pytest.param("deepseek-v3-qlora", write_fp8_checkpoint, id="fp8-blockwise"),
        pytest.param("deepseek-v3", write_int4_experts_checkpoint, id="int4-experts"),
    ],
)
def test_a_quantized_checkpoint_gives_the_dequantized_models_tokens(
    tmp_path, architecture, quantize
):
    source = build_tiny_model(tmp_path / "source", architecture)
    quantized = quantize(source, tmp_path / "quantized")
    expected = hf_greedy(dequantized_copy(quantized, tmp_path / "dequantized"), PROMPTS, 12)
    llm = LLM(str(quantized), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in llm.generate(PROMPTS, params)] == expected
    # Quantization changed the weights enough to matter: the engine runs what was stored.
    assert expected != hf_greedy(source, PROMPTS, 12)

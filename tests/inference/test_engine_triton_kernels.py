"""The engine on its Triton kernels (`HEARTH_KERNELS=triton`, run by Triton's interpreter on the
CPU) produces the same greedy tokens as on the PyTorch references (which give transformers'
tokens: test_oracle_tiny.py, test_oracle_moe.py), for dense, sparse and MLA families, with prefix
caching and chunked prefill on, so decode, extend-over-a-cached-prefix and plain prefill all run
(and for MoE families the router and fused-MoE kernels, for MLA its store, decode and prefill)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from inference.engine import LLM, SamplingParams
from tests.inference.tiny_models import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 10
# Small blocks and a small step budget: prompts span several blocks, prefills are chunked, and
# decodes share steps with chunks of other prompts.
OPTIONS = {"dtype": "float32", "block_size": 16, "max_num_batched_tokens": 24}

GENERATE = """
import json, sys
import torch
import kernels
from kernels.attention import paged_attention_triton
from inference.engine import LLM, SamplingParams

assert kernels.dispatch.select(kernels.ATTENTION, torch.zeros(1)) is paged_attention_triton
model_dir, options, rounds = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(model_dir, **options)
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[4]), ignore_eos=True)
results = [
    [[r.token_ids, r.cached_tokens] for r in llm.generate(prompts, params)] for prompts in rounds
]
print(json.dumps(results))
"""


def agent_rounds(vocab_size: int) -> list[list[list[int]]]:
    """Two rounds of prompts: the second repeats the first's prompts grown by a few tokens, as an
    agent's next turn does, so it hits the prefix cache (extend attention over cached blocks)."""
    rng = random.Random()
    first = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (5, 19, 40)]
    second = [p + [rng.randrange(3, vocab_size) for _ in range(7)] for p in first]
    return [first, second]


# llama runs the dense kernels, qwen2-moe the router and fused-MoE kernels (and a shared expert),
# deepseek-v3-qlora those and MLA's three. Qwen3 (its QK norm is a torch op), Mixtral and
# DeepSeek-V3 without a query LoRA add no kernel (kept out for time).
@pytest.mark.parametrize("architecture", ["llama", "qwen2-moe", "deepseek-v3-qlora"])
def test_triton_kernels_give_the_reference_paths_greedy_tokens(tmp_path, architecture):
    model_dir = build_tiny_model(tmp_path / architecture, architecture)
    llm = LLM(str(model_dir), **OPTIONS)
    rounds = agent_rounds(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    expected = [[[r.token_ids, r.cached_tokens] for r in llm.generate(p, params)] for p in rounds]
    # The second round really reuses cached blocks (for the prompts that fill one), so the
    # extend kernel reads a prefix; the 5-token prompt is a plain prefill again.
    assert [cached > 0 for _, cached in expected[1]] == [False, True, True]

    env = {**os.environ, "HEARTH_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            GENERATE,
            str(model_dir),
            json.dumps(OPTIONS),
            json.dumps(rounds),
            str(MAX_NEW),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected

"""Fixtures for engine tests: tiny random models and Hugging Face greedy references."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.inference.tiny_models import build_tiny_model


@pytest.fixture(
    scope="session", params=["llama", "llama3-rope", "yarn-rope", "mistral", "qwen2", "qwen3"]
)
def tiny_model_dir(request, tmp_path_factory):
    """A tiny random-weight model directory, one per supported architecture family."""
    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


def hf_generate_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from a Hugging Face model, one prompt at a time (no padding)."""
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            results.append(out[0, len(prompt) :].tolist())
    return results


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from Hugging Face transformers in float32, never stopping early
    (the engine runs with ignore_eos to match)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return hf_generate_greedy(model, prompts, max_new_tokens)

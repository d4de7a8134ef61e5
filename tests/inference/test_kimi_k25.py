"""A Kimi K2.5 directory (a `kimi_k25` config nesting a DeepSeek-V3 text config; the language
model's weights under `language_model.`, a vision tower beside them) serves its text model with
the DeepSeek-V3 oracle's tokens; the vision tower is left out with a warning, not silently."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inference.engine import LLM, SamplingParams
from tests.inference.conftest import hf_greedy
from tests.inference.tiny_models import build_tiny_model

VISION_WEIGHTS = {
    "vision_tower.encoder.blocks.0.mlp.fc0.weight": torch.randn(32, 16),
    "mm_projector.proj.0.weight": torch.randn(64, 32),
}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(the DeepSeek-V3 text model's directory, the same weights as a Kimi K2.5 directory)."""
    text = build_tiny_model(tmp_path_factory.mktemp("deepseek"), "deepseek-v3")
    kimi = tmp_path_factory.mktemp("kimi-k25")
    for file in text.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, kimi / file.name)
    text_config = json.loads((text / "config.json").read_text())
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {**text_config, "model_type": "kimi_k2"},
        "vision_config": {"model_type": "kimi_k25_vision"},
    }
    (kimi / "config.json").write_text(json.dumps(config))
    tensors = dict(VISION_WEIGHTS)
    with safe_open(str(text / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            tensors["language_model." + name] = f.get_tensor(name)
    save_file(tensors, str(kimi / "model.safetensors"))
    return text, kimi


def test_the_text_model_of_a_kimi_k25_directory_gives_deepseek_v3s_tokens(kimi, caplog):
    text, kimi_dir = kimi
    prompts = [[5, 9, 17, 40, 41, 3], list(range(3, 40))]
    expected = hf_greedy(text, prompts, 12)
    with caplog.at_level(logging.WARNING, logger="inference.models.loader"):
        llm = LLM(str(kimi_dir), dtype="float32")
    assert llm.engine.model_config.architecture == "deepseek_v3"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected
    assert f"{len(VISION_WEIGHTS)} vision-tower weights not loaded" in caplog.text


def test_a_kimi_k2_directory_serves_as_deepseek_v3(kimi, tmp_path):
    """Kimi K2 ships `model_type: kimi_k2` (remote code transformers does not register) for
    DeepSeek-V3's architecture: read as DeepSeek-V3, no remote code run."""
    text, _ = kimi
    k2 = tmp_path / "kimi-k2"
    shutil.copytree(text, k2)
    config = json.loads((k2 / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.X"})
    (k2 / "config.json").write_text(json.dumps(config))
    prompts = [[5, 9, 17, 40, 41, 3]]
    llm = LLM(str(k2), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in llm.generate(prompts, params)] == hf_greedy(text, prompts, 12)

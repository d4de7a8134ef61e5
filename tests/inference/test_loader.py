"""Model loading: the GGUF conversion is cached, and the cache is what later starts load."""

from __future__ import annotations

import pytest

from inference.models import loader


@pytest.mark.smollm2
def test_second_load_uses_the_converted_cache_without_reconverting(monkeypatch):
    directory = loader.resolve_model_directory("SmolLM2-135M-Instruct")
    assert (directory / "model.safetensors").is_file()
    assert (directory / "tokenizer.json").is_file() and (directory / "config.json").is_file()

    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    assert loader.resolve_model_directory("smollm2") == directory


def test_default_model_aliases_resolve_to_the_packaged_gguf():
    path = loader.default_model_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    assert loader.gguf_architecture(path) == "llama"

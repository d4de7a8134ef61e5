"""GGUF files of the MoE families, read back through transformers' GGUF loader, the way Hearth
converts a GGUF once into a Hugging Face directory."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from inference.engine import LLM, SamplingParams
from inference.errors import ModelLoadError
from inference.models.loader import gguf_architecture, gguf_to_hf_directory
from tests.inference.conftest import hf_greedy
from tests.inference.gguf_files import write_gguf
from tests.inference.tiny_models import build_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "<|im_start|>user\nHéllo wörld 日本語 🚀<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):\n    return a + b\n  0123456789  ",
]


def build_moe_model(directory, model_type: str, **overrides):
    """A tiny random-weight MoE model with the byte-level BPE tokenizer, saved to `directory`.

    transformers' GGUF reader takes the experts' width from the config class's default, not from
    the file's `expert_feed_forward_length` (see the test below), so the models here keep it.
    """
    directory.mkdir(parents=True)
    tokenizer = build_tokenizer(directory)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if model_type == "qwen2_moe":
        config = Qwen2MoeConfig(**common, num_experts=4, **overrides)
    elif model_type == "qwen3_moe":
        # llama.cpp always renormalises Qwen3-MoE's top-k weights, and transformers' reader sets
        # norm_topk_prob accordingly.
        config = Qwen3MoeConfig(
            **common, num_experts=4, head_dim=24, norm_topk_prob=True, **overrides
        )
    else:
        config = MixtralConfig(**common, num_local_experts=4, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(directory))
    return model


@pytest.mark.parametrize(
    "model_type, architecture", [("qwen2_moe", "qwen2moe"), ("qwen3_moe", "qwen3moe")]
)
def test_moe_gguf_reads_back_exactly_through_transformers(tmp_path, model_type, architecture):
    original = build_moe_model(tmp_path / "hf", model_type)
    path = write_gguf(tmp_path / "hf", tmp_path / "gguf" / "tiny.gguf")

    assert gguf_architecture(path) == architecture
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    assert type(model) is type(original)
    fields = (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "head_dim",
        "norm_topk_prob",
    )
    for field in fields:
        assert getattr(model.config, field, None) == getattr(original.config, field, None), field
    expected, loaded = original.state_dict(), model.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name

    reference = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        assert tokenizer(text).input_ids == reference(text).input_ids, text
    assert tokenizer.eos_token == reference.eos_token
    assert tokenizer.chat_template == reference.chat_template


def test_transformers_ignores_the_expert_width_a_gguf_states(tmp_path):
    # llama.cpp writes qwen3moe.expert_feed_forward_length; transformers 5.24's reader does not
    # map it, so a model whose experts are not the config default's 768 wide does not load. When
    # this fails, transformers reads the width and the models above need not keep the default.
    build_moe_model(tmp_path / "hf", "qwen3_moe", moe_intermediate_size=32)
    path = write_gguf(tmp_path / "hf", tmp_path / "gguf" / "tiny.gguf")
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)


def test_mixtral_gguf_is_read_as_a_dense_llama_without_its_experts(tmp_path):
    # llama.cpp stores Mixtral as `llama` with stacked experts. transformers reads that as a dense
    # Llama, drops the experts and initialises an MLP at random, with no error: a loader must
    # refuse `llama` files with experts rather than convert them.
    original = build_moe_model(tmp_path / "hf", "mixtral").state_dict()
    path = write_gguf(tmp_path / "hf", tmp_path / "gguf" / "tiny.gguf")

    assert gguf_architecture(path) == "llama"
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "LlamaForCausalLM"
    assert set(info["missing_keys"]) == {
        f"model.layers.{layer}.mlp.{projection}_proj.weight"
        for layer in range(2)
        for projection in ("gate", "up", "down")
    }
    # Everything else reads back exactly, q and k through transformers' reversal of llama.cpp's
    # rotary permutation.
    loaded = model.state_dict()
    for name, tensor in original.items():
        if ".mlp." not in name:
            assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_the_engine_serves_a_moe_gguf_with_transformers_greedy_tokens(tmp_path, model_type):
    build_moe_model(tmp_path / "hf", model_type)
    path = write_gguf(tmp_path / "hf", tmp_path / "gguf" / "tiny.gguf")
    directory = gguf_to_hf_directory(path, tmp_path / "cache")
    prompts = [[5, 9, 17, 40, 41, 3], list(range(3, 40))]
    expected = hf_greedy(directory, prompts, 12)
    llm = LLM(str(path), dtype="float32", cache_dir=str(tmp_path / "cache"))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected


def test_a_mixtral_gguf_is_refused_not_converted_without_its_experts(tmp_path):
    build_moe_model(tmp_path / "hf", "mixtral")
    path = write_gguf(tmp_path / "hf", tmp_path / "gguf" / "tiny.gguf")
    with pytest.raises(ModelLoadError, match="llama GGUF with 4 experts"):
        gguf_to_hf_directory(path, tmp_path / "cache")

"""The architecture facts the engine needs, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_MODEL_TYPES = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}


@dataclass
class ModelConfig:
    """Dimensions and options of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    inv_freq: torch.Tensor
    attention_scaling: float

    @classmethod
    def from_hf(cls, hf_config) -> ModelConfig:
        architectures = getattr(hf_config, "architectures", None) or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not architectures:
            arch = _MODEL_TYPES.get(getattr(hf_config, "model_type", None))
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {architectures or hf_config.model_type!r}; "
                f"the engine implements {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        if family == "mistral" and getattr(hf_config, "sliding_window", None):
            window = hf_config.sliding_window
            if window < hf_config.max_position_embeddings:
                raise ModelLoadError(
                    f"sliding-window attention (window {window}) is not implemented"
                )
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"activation {hf_config.hidden_act!r} is not implemented")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        inv_freq, attention_scaling = _rope_inv_freq(hf_config)
        return cls(
            architecture=family,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=family == "qwen3",
            inv_freq=inv_freq,
            attention_scaling=attention_scaling,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


def _rope_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies with the model's rope scaling, computed by transformers' own rope
    initialisers so that scaled variants (linear, dynamic, llama3, yarn) match the oracle."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        base = rope_parameters.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        dim = int(head_dim * rope_parameters.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    if rope_type not in ("linear", "llama3", "yarn"):
        raise ModelLoadError(f"rope scaling {rope_type!r} is not implemented")
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq, float(attention_scaling)

"""The architecture facts the engine needs, read from a Hugging Face config.

One `ModelConfig` describes every family the engine serves: the Llama-family decoder (Llama,
Mistral, Qwen2, Qwen3, SmolLM2), the sparse families (Mixtral, Qwen2-MoE, Qwen3-MoE: `moe` set)
and DeepSeek-V3 with its Kimi K2 / K2.5 descendants (Multi-head Latent Attention: `mla` set, and
`moe` with grouped sigmoid routing). A Kimi K2.5 config nests its language model under
`text_config`; that is the config read here (`text_config_of`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from inference.distributed.parallel import Parallel
from inference.distributed.sharding import (
    attention_heads,
    expert_intermediate_share,
    expert_share,
)
from inference.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

_MODEL_TYPES = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
# Model types transformers does not register, for an architecture it does: Kimi K2 ships
# `kimi_k2` (with remote code) for DeepSeek-V3's architecture, as transformers' own Kimi K2.5
# config maps it.
_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
# Multimodal configs whose language model is one of the families above.
_NESTED_TEXT_CONFIGS = {"kimi_k25": "vision_config"}


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: `num_experts` routed experts, `top_k` per token, optional shared experts."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    scoring: str  # "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3)
    renormalize: bool  # the k weights rescaled to sum to 1
    num_expert_group: int | None  # grouped selection (DeepSeek-V3's n_group)
    topk_group: int | None
    routed_scaling_factor: float
    correction_bias: bool  # DeepSeek-V3's e_score_correction_bias (chooses, does not weigh)
    router_fp32: bool  # the router's matmul in float32 (DeepSeek-V3) or the model's dtype
    shared_intermediate_size: int  # 0 when there is no shared expert
    shared_expert_gate: bool  # Qwen2-MoE scales its shared expert by sigmoid(gate · x)
    dense_layers: frozenset[int]  # layers that keep a dense MLP

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2/V3): keys and values are decompressed from a
    `kv_lora_rank` latent that the cache stores once per token, beside one rope key."""

    q_lora_rank: int | None  # None: the query is one projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # qk_head_dim ** -0.5, times yarn's mscale squared
    rope_interleave: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class ModelConfig:
    """Dimensions and options of a decoder the engine serves."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of a dense MLP
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
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None

    @classmethod
    def from_hf(cls, hf_config) -> ModelConfig:
        hf_config = text_config_of(hf_config)
        family = _family(hf_config)
        if family == "mistral" and getattr(hf_config, "sliding_window", None):
            window = hf_config.sliding_window
            if window < hf_config.max_position_embeddings:
                raise ModelLoadError(
                    f"sliding-window attention (window {window}) is not implemented"
                )
        if family in ("qwen2_moe", "qwen3_moe") and getattr(hf_config, "use_sliding_window", False):
            raise ModelLoadError("sliding-window attention is not implemented")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"activation {hf_config.hidden_act!r} is not implemented")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        inv_freq, attention_scaling = _rope_inv_freq(hf_config)
        mla = _mla_config(hf_config) if family == "deepseek_v3" else None
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
            attention_bias=_attention_bias(family, hf_config),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            inv_freq=inv_freq,
            attention_scaling=attention_scaling,
            moe=_moe_config(family, hf_config),
            mla=mla,
        )

    def for_rank(self, parallel: Parallel) -> ModelConfig:
        """The dimensions one rank of `parallel` computes with (itself for one device): its query
        and KV heads (`sharding.attention_heads`: KV heads replicated when there are fewer than
        ranks) and its share of each intermediate size, so that `kv_cache_shape` is the rank's
        cache. The vocabulary, the hidden size and the routed experts' count stay whole (every
        rank holds the whole hidden state and routes over every expert); MLA's latent cache row
        is the same on every rank. A ValueError when the heads or sizes do not split."""
        if not parallel.distributed:
            return self
        if parallel.data_parallel_attention:
            if self.moe is not None:
                expert_share(self.moe.num_experts, parallel)  # whole experts, evenly spread
            return self  # every rank computes every head of its own sequences
        heads = attention_heads(self.num_heads, self.num_kv_heads, parallel)
        moe = self.moe
        if moe is not None:
            start, stop = expert_intermediate_share(moe.intermediate_size, parallel)
            expert_share(moe.num_experts, parallel)  # refuses experts that do not spread evenly
            shared = parallel.share(moe.shared_intermediate_size, "shared expert size")
            moe = replace(
                moe, intermediate_size=stop - start, shared_intermediate_size=shared[1] - shared[0]
            )
        start, stop = parallel.share(self.intermediate_size, "intermediate size")
        return replace(
            self,
            num_heads=heads.num_heads,
            num_kv_heads=heads.num_kv_heads,
            intermediate_size=stop - start,
            moe=moe,
        )

    @property
    def kv_cache_shape(self) -> tuple[int, int, int]:
        """Per token and layer: (kinds, heads, dim) of what the paged cache stores. Keys and
        values per KV head (2, Hk, D); for MLA one row [latent | rope key] shared by every head
        (1, 1, kv_lora_rank + qk_rope_head_dim)."""
        if self.mla is not None:
            return 1, 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes the paged cache holds per token over all layers."""
        kinds, heads, dim = self.kv_cache_shape
        return self.num_layers * kinds * heads * dim * _element_bytes(dtype)

    def mha_kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What a cache of per-head keys and values would hold per token for the same model
        (for MLA: every head's decompressed key and value, the cache MLA exists to avoid)."""
        if self.mla is None:
            return self.kv_bytes_per_token(dtype)
        per_head = self.mla.qk_head_dim + self.mla.v_head_dim
        return self.num_layers * self.num_heads * per_head * _element_bytes(dtype)


def read_hf_config(directory: Path):
    """The transformers config of a model directory, reading an aliased model type
    (`_MODEL_TYPE_ALIASES`) as its architecture's config; never runs remote code."""
    from transformers import AutoConfig

    try:
        raw = json.loads((directory / "config.json").read_text())
        alias = _MODEL_TYPE_ALIASES.get(raw.get("model_type"))
        if alias is not None:
            fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
            return AutoConfig.for_model(alias, **fields)
        return AutoConfig.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the config of {directory}: {exc}") from exc


def text_config_of(hf_config):
    """The language model's config: `hf_config` itself, or the `text_config` a multimodal
    config nests (its vision tower's weights are left out by the loader, with a warning)."""
    if getattr(hf_config, "model_type", None) in _NESTED_TEXT_CONFIGS:
        text = hf_config.text_config
        if not getattr(text, "architectures", None):
            text.architectures = [_MODEL_TYPES.get(text.model_type, text.model_type)]
        return text
    return hf_config


def _family(hf_config) -> str:
    architectures = getattr(hf_config, "architectures", None) or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not architectures:
        arch = _MODEL_TYPES.get(getattr(hf_config, "model_type", None))
    if arch is None and getattr(hf_config, "model_type", None) in _MODEL_TYPES:
        # Kimi K2 ships remote code under its own class name for the deepseek_v3 architecture.
        arch = _MODEL_TYPES[hf_config.model_type]
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {architectures or hf_config.model_type!r}; "
            f"the engine implements {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return SUPPORTED_ARCHITECTURES[arch]


def _attention_bias(family: str, hf_config) -> bool:
    """Qwen2 and Qwen2-MoE have q/k/v biases (Qwen2-MoE's `qkv_bias` can turn them off)."""
    if family in ("qwen2", "qwen2_moe"):
        return bool(getattr(hf_config, "qkv_bias", True))
    return bool(getattr(hf_config, "attention_bias", False))


def _moe_config(family: str, hf_config) -> MoEConfig | None:
    layers = range(hf_config.num_hidden_layers)
    if family == "mixtral":
        return MoEConfig(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            scoring="softmax",
            renormalize=True,
            num_expert_group=None,
            topk_group=None,
            routed_scaling_factor=1.0,
            correction_bias=False,
            router_fp32=False,
            shared_intermediate_size=0,
            shared_expert_gate=False,
            dense_layers=frozenset(),
        )
    if family in ("qwen2_moe", "qwen3_moe"):
        step = hf_config.decoder_sparse_step
        only_mlp = set(getattr(hf_config, "mlp_only_layers", None) or [])
        dense = {i for i in layers if i in only_mlp or (i + 1) % step or not hf_config.num_experts}
        return MoEConfig(
            num_experts=hf_config.num_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            scoring="softmax",
            renormalize=bool(hf_config.norm_topk_prob),
            num_expert_group=None,
            topk_group=None,
            routed_scaling_factor=1.0,
            correction_bias=False,
            router_fp32=False,
            shared_intermediate_size=getattr(hf_config, "shared_expert_intermediate_size", 0)
            if family == "qwen2_moe"
            else 0,
            shared_expert_gate=family == "qwen2_moe",
            dense_layers=frozenset(dense),
        )
    if family == "deepseek_v3":
        if getattr(hf_config, "topk_method", "noaux_tc") != "noaux_tc":
            raise ModelLoadError(f"MoE routing {hf_config.topk_method!r} is not implemented")
        groups = hf_config.n_group
        return MoEConfig(
            num_experts=hf_config.n_routed_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            scoring="sigmoid",
            renormalize=bool(hf_config.norm_topk_prob),
            num_expert_group=groups,
            topk_group=hf_config.topk_group,
            routed_scaling_factor=float(hf_config.routed_scaling_factor),
            correction_bias=True,
            router_fp32=True,
            shared_intermediate_size=hf_config.moe_intermediate_size
            * (hf_config.n_shared_experts or 0),
            shared_expert_gate=False,
            dense_layers=frozenset(range(min(hf_config.first_k_dense_replace, len(layers)))),
        )
    return None


def _mla_config(hf_config) -> MLAConfig:
    qk_head_dim = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
    scale = qk_head_dim**-0.5
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        # YaRN's attention-scale correction, applied to the softmax scale squared (DeepSeek-V3).
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return MLAConfig(
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_nope_head_dim=hf_config.qk_nope_head_dim,
        qk_rope_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        softmax_scale=scale,
        rope_interleave=bool(getattr(hf_config, "rope_interleave", True)),
    )


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _rope_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies with the model's rope scaling, computed by transformers' own rope
    initialisers so that scaled variants (linear, dynamic, llama3, yarn) match the oracle.
    DeepSeek-V3's config names its rope dimension (qk_rope_head_dim) `head_dim`."""
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

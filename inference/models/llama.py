"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) on Hearth's named ops.

Projections are fused (q|k|v and gate|up) so each layer runs four matrix products. Weights are
plain tensors: the engine never trains, so there is no autograd state to carry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels as ops
from inference.models.model_config import ModelConfig


@dataclass
class ForwardBatch:
    """The per-step inputs every layer needs."""

    positions: torch.Tensor  # [T]
    rotary_cos: torch.Tensor  # [T, 1, rotary_dim / 2], from `rotary_tables`
    rotary_sin: torch.Tensor
    slot_mapping: torch.Tensor  # [T]
    attention: ops.PagedAttentionBatch


class LlamaLayer:
    """One pre-norm decoder layer's weights."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        hidden, inter = config.hidden_size, config.intermediate_size
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.input_norm = torch.ones(hidden, dtype=dtype)
        self.qkv_proj = torch.empty(q_size + 2 * kv_size, hidden, dtype=dtype)
        self.qkv_bias = (
            torch.zeros(q_size + 2 * kv_size, dtype=dtype) if config.attention_bias else None
        )
        self.q_norm = torch.ones(config.head_dim, dtype=dtype) if config.qk_norm else None
        self.k_norm = torch.ones(config.head_dim, dtype=dtype) if config.qk_norm else None
        self.o_proj = torch.empty(hidden, q_size, dtype=dtype)
        self.post_attention_norm = torch.ones(hidden, dtype=dtype)
        self.gate_up_proj = torch.empty(2 * inter, hidden, dtype=dtype)
        self.down_proj = torch.empty(hidden, inter, dtype=dtype)


class LlamaModel:
    """Embedding, decoder layers, final norm and LM head."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        self.config = config
        self.dtype = dtype
        self.embed_tokens = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = [LlamaLayer(config, dtype) for _ in range(config.num_layers)]
        self.norm = torch.ones(config.hidden_size, dtype=dtype)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
        )
        self.cos_cache, self.sin_cache = ops.build_cos_sin_cache(
            config.inv_freq, max_positions, config.attention_scaling
        )
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for the flattened batch `input_ids`."""
        hidden = self.embed_tokens.index_select(0, input_ids)
        eps = self.config.rms_norm_eps
        residual = hidden
        hidden, _ = ops.rms_norm(hidden, self.layers[0].input_norm, eps)
        for index, (layer, (k_cache, v_cache)) in enumerate(
            zip(self.layers, kv_caches, strict=True)
        ):
            if index:
                hidden, residual = ops.rms_norm(hidden, layer.input_norm, eps, residual)
            hidden = self._attention(layer, hidden, batch, k_cache, v_cache)
            hidden, residual = ops.rms_norm(hidden, layer.post_attention_norm, eps, residual)
            gate_up = ops.linear(hidden, layer.gate_up_proj)
            hidden = ops.linear(ops.silu_and_mul(gate_up), layer.down_proj)
        hidden, _ = ops.rms_norm(hidden, self.norm, eps, residual)
        return hidden

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token rotary tables for one step, shared by every layer."""
        return ops.rotary_cos_sin(self.cos_cache, self.sin_cache, positions, self.dtype)

    def pack_weights(self, quantization: str | None = None) -> None:
        """Put every projection in the layout `ops.linear` runs fastest from (after loading).

        With `quantization="int4"` the decoder layers' projections become int4 weights; the LM
        head stays bf16 (llama.cpp's 4-bit files keep it at 8 bits or more too).
        """
        for layer in self.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                weight = getattr(layer, name)
                if quantization == "int4":
                    setattr(layer, name, ops.Int4Weight.quantize(weight))
                else:
                    setattr(layer, name, ops.pack_linear_weight(weight))
        self.lm_head = ops.pack_linear_weight(self.lm_head)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the rows of `hidden` that sample a token."""
        return ops.linear(hidden, self.lm_head).float()

    def _attention(
        self,
        layer: LlamaLayer,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        config = self.config
        num_tokens = hidden.shape[0]
        qkv = ops.linear(hidden, layer.qkv_proj, layer.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, config.num_heads, config.head_dim)
        k = k.reshape(num_tokens, config.num_kv_heads, config.head_dim)
        v = v.reshape(num_tokens, config.num_kv_heads, config.head_dim)
        if layer.q_norm is not None:
            q, _ = ops.rms_norm(q, layer.q_norm, config.rms_norm_eps)
            k, _ = ops.rms_norm(k, layer.k_norm, config.rms_norm_eps)
        ops.rotary(q, k, batch.rotary_cos, batch.rotary_sin)
        ops.store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping)
        out = ops.attention(q, k, v, k_cache, v_cache, batch.attention, self.scale)
        return ops.linear(out, layer.o_proj)

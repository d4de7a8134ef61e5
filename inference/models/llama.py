"""Llama-family attention (Llama, Mistral, Qwen2, Qwen3, SmolLM2; Mixtral's and the Qwen MoEs'
too): grouped-query attention with q|k|v fused into one projection, optional q/k biases (Qwen2)
and per-head q/k RMSNorm (Qwen3), rotary embeddings, keys and values per KV head in the paged
cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import kernels as ops
from inference.models.checkpoint import Checkpoint
from inference.models.mlp import pack_projection
from inference.models.model_config import ModelConfig

if TYPE_CHECKING:
    from inference.models.decoder import ForwardBatch


class LlamaAttention:
    """One layer's attention weights and its forward over the paged cache."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        self.config = config
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        hidden, qkv_size = config.hidden_size, self.q_size + 2 * self.kv_size
        self.qkv_proj = torch.empty(qkv_size, hidden, dtype=dtype)
        self.qkv_bias = torch.zeros(qkv_size, dtype=dtype) if config.attention_bias else None
        self.q_norm = torch.ones(config.head_dim, dtype=dtype) if config.qk_norm else None
        self.k_norm = torch.ones(config.head_dim, dtype=dtype) if config.qk_norm else None
        self.o_proj = torch.empty(hidden, self.q_size, dtype=dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        config = self.config
        k_cache, v_cache = cache
        num_tokens = hidden.shape[0]
        qkv = ops.linear(hidden, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, config.num_heads, config.head_dim)
        k = k.reshape(num_tokens, config.num_kv_heads, config.head_dim)
        v = v.reshape(num_tokens, config.num_kv_heads, config.head_dim)
        if self.q_norm is not None:
            q, _ = ops.rms_norm(q, self.q_norm, config.rms_norm_eps)
            k, _ = ops.rms_norm(k, self.k_norm, config.rms_norm_eps)
        ops.rotary(q, k, batch.rotary_cos, batch.rotary_sin)
        ops.store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping)
        out = ops.attention(q, k, v, k_cache, v_cache, batch.attention, self.scale)
        return ops.linear(out, self.o_proj)

    def load(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Copy `prefix{q,k,v,o}_proj` (and biases, q/k norms) into the fused layout."""
        take = checkpoint.take
        self.qkv_proj.copy_(torch.cat([take(f"{prefix}{p}_proj.weight") for p in "qkv"], dim=0))
        if self.qkv_bias is not None:
            self.qkv_bias.copy_(torch.cat([take(f"{prefix}{p}_proj.bias") for p in "qkv"], dim=0))
        if self.q_norm is not None:
            self.q_norm.copy_(take(prefix + "q_norm.weight"))
            self.k_norm.copy_(take(prefix + "k_norm.weight"))
        self.o_proj.copy_(take(prefix + "o_proj.weight"))

    def pack(self, quantization: str | None) -> None:
        self.qkv_proj = pack_projection(self.qkv_proj, quantization)
        self.o_proj = pack_projection(self.o_proj, quantization)

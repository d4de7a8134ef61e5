"""Llama-family attention (Llama, Mistral, Qwen2, Qwen3, SmolLM2; Mixtral's and the Qwen MoEs'
too): grouped-query attention with q|k|v fused into one projection, optional q/k biases (Qwen2)
and per-head q/k RMSNorm (Qwen3), rotary embeddings, keys and values per KV head in the paged
cache.

Across a group of ranks it is split by heads (`sharding.attention_heads`): the fused projection
holds this rank's query heads and the KV heads they read (column-parallel), o_proj the matching
columns (row-parallel), and one all-reduce completes the output."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import kernels as ops
from inference.distributed.parallel import Parallel
from inference.distributed.sharding import Slices, attention_heads
from inference.models.checkpoint import Checkpoint
from inference.models.mlp import pack_projection
from inference.models.model_config import ModelConfig

if TYPE_CHECKING:
    from inference.models.decoder import ForwardBatch


class LlamaAttention:
    """One layer's attention weights (this rank's heads) and its forward over the paged cache."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, parallel: Parallel) -> None:
        self.config = config
        self.parallel = parallel
        self.heads = attention_heads(config.num_heads, config.num_kv_heads, parallel)
        self.num_heads, self.num_kv_heads = self.heads.num_heads, self.heads.num_kv_heads
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
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
        q = q.reshape(num_tokens, self.num_heads, config.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, config.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, config.head_dim)
        if self.q_norm is not None:
            q, _ = ops.rms_norm(q, self.q_norm, config.rms_norm_eps)
            k, _ = ops.rms_norm(k, self.k_norm, config.rms_norm_eps)
        ops.rotary(q, k, batch.rotary_cos, batch.rotary_sin)
        ops.store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping)
        out = ops.attention(q, k, v, k_cache, v_cache, batch.attention, self.scale)
        return self.parallel.all_reduce(ops.linear(out, self.o_proj))

    def load(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Read this rank's heads of `prefix{q,k,v}_proj` (and biases) into the fused layout,
        the q/k norms, and its columns of o_proj."""
        head_dim, heads = self.config.head_dim, self.heads
        q_rows = (heads.q_start * head_dim, heads.q_stop * head_dim)
        kv_rows = (heads.kv_start * head_dim, heads.kv_stop * head_dim)
        shares = {"q": Slices.of(0, q_rows), "k": Slices.of(0, kv_rows), "v": Slices.of(0, kv_rows)}

        def fused(kind: str) -> torch.Tensor:
            names = [(f"{prefix}{p}_proj.{kind}", shares[p]) for p in "qkv"]
            return torch.cat([checkpoint.take(name, part=part) for name, part in names], dim=0)

        self.qkv_proj.copy_(fused("weight"))
        if self.qkv_bias is not None:
            self.qkv_bias.copy_(fused("bias"))
        if self.q_norm is not None:
            self.q_norm.copy_(checkpoint.take(prefix + "q_norm.weight"))
            self.k_norm.copy_(checkpoint.take(prefix + "k_norm.weight"))
        self.o_proj.copy_(checkpoint.take(prefix + "o_proj.weight", part=Slices.of(1, q_rows)))

    def pack(self, quantization: str | None) -> None:
        self.qkv_proj = pack_projection(self.qkv_proj, quantization)
        self.o_proj = pack_projection(self.o_proj, quantization)

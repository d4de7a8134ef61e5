"""The decoder every family shares: embedding, pre-norm layers of attention and MLP, final norm,
LM head. A layer's attention is Llama-family GQA (`LlamaAttention`) or Multi-head Latent
Attention (`MLAttention`); its MLP is dense (`DenseMLP`) or sparse (`SparseMoE`), as the config
says. The model file reads like the papers; every computation is a named op in `kernels`.

Weights are plain tensors: the engine never trains, so there is no autograd state to carry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels as ops
from inference.models.checkpoint import Checkpoint
from inference.models.llama import LlamaAttention
from inference.models.mla import MLAttention
from inference.models.mlp import DenseMLP, pack_projection
from inference.models.model_config import ModelConfig
from inference.models.moe import SparseMoE


@dataclass
class ForwardBatch:
    """The per-step inputs every layer needs."""

    positions: torch.Tensor  # [T]
    rotary_cos: torch.Tensor  # [T, 1, rotary_dim / 2], from `rotary_tables`
    rotary_sin: torch.Tensor
    slot_mapping: torch.Tensor  # [T]
    attention: ops.PagedAttentionBatch


class DecoderLayer:
    """One pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype) -> None:
        hidden = config.hidden_size
        self.input_norm = torch.ones(hidden, dtype=dtype)
        self.post_attention_norm = torch.ones(hidden, dtype=dtype)
        self.attention = (
            MLAttention(config, dtype) if config.mla is not None else LlamaAttention(config, dtype)
        )
        if config.moe is not None and config.moe.is_sparse(index):
            self.mlp = SparseMoE(config.moe, hidden, dtype)
        else:
            self.mlp = DenseMLP(hidden, config.intermediate_size, dtype)


class DecoderModel:
    """Embedding, decoder layers, final norm and LM head."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        self.config = config
        self.dtype = dtype
        self.embed_tokens = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = [DecoderLayer(config, index, dtype) for index in range(config.num_layers)]
        self.sparse_layers = [
            layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)
        ]
        self.norm = torch.ones(config.hidden_size, dtype=dtype)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
        )
        self.cos_cache, self.sin_cache = ops.build_cos_sin_cache(
            config.inv_freq, max_positions, config.attention_scaling
        )

    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, kv_caches: list
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for the flattened batch `input_ids`;
        `kv_caches` holds each layer's cache (`inference.engine.kv_cache.layer_caches`)."""
        hidden = self.embed_tokens.index_select(0, input_ids)
        eps = self.config.rms_norm_eps
        residual = hidden
        hidden, _ = ops.rms_norm(hidden, self.layers[0].input_norm, eps)
        for index, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if index:
                hidden, residual = ops.rms_norm(hidden, layer.input_norm, eps, residual)
            hidden = layer.attention.forward(hidden, batch, cache)
            hidden, residual = ops.rms_norm(hidden, layer.post_attention_norm, eps, residual)
            hidden = layer.mlp.forward(hidden)
        hidden, _ = ops.rms_norm(hidden, self.norm, eps, residual)
        return hidden

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token rotary tables for one step, shared by every layer."""
        return ops.rotary_cos_sin(self.cos_cache, self.sin_cache, positions, self.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the rows of `hidden` that sample a token."""
        return ops.linear(hidden, self.lm_head).float()

    def load(self, checkpoint: Checkpoint) -> None:
        """Copy a checkpoint's weights (Hugging Face names, `model.` prefix removed) in."""
        family = self.config.architecture
        self.embed_tokens.copy_(checkpoint.take("embed_tokens.weight"))
        self.norm.copy_(checkpoint.take("norm.weight"))
        if not self.config.tie_word_embeddings:
            self.lm_head.copy_(checkpoint.take("lm_head.weight"))
        else:
            checkpoint.take_optional("lm_head.weight")
        for index, layer in enumerate(self.layers):
            prefix = f"layers.{index}."
            layer.input_norm.copy_(checkpoint.take(prefix + "input_layernorm.weight"))
            layer.post_attention_norm.copy_(
                checkpoint.take(prefix + "post_attention_layernorm.weight")
            )
            layer.attention.load(checkpoint, prefix + "self_attn.")
            mlp_prefix = prefix + ("block_sparse_moe." if family == "mixtral" else "mlp.")
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.load(checkpoint, mlp_prefix, family)
            else:
                layer.mlp.load(checkpoint, mlp_prefix)

    def pack_weights(self, quantization: str | None = None) -> None:
        """Put every projection in the layout `ops.linear` runs fastest from (after loading).

        With `quantization="int4"` the decoder layers' dense projections become int4 weights;
        the LM head stays bf16 (llama.cpp's 4-bit files keep it at 8 bits or more too) and the
        routed experts stay as loaded (`fused_moe` takes them whole).
        """
        for layer in self.layers:
            layer.attention.pack(quantization)
            layer.mlp.pack(quantization)
        self.lm_head = pack_projection(self.lm_head, None)

    def expert_tokens(self, last_step: bool = False) -> torch.Tensor | None:
        """Tokens routed to each expert, summed over the sparse layers ([E]): since load, or in
        the last step; None for a dense model."""
        if not self.sparse_layers:
            return None
        counts = [
            mlp.last_step_tokens if last_step else mlp.expert_tokens for mlp in self.sparse_layers
        ]
        return torch.stack(counts).sum(0)

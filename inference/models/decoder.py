"""The decoder every family shares: embedding, pre-norm layers of attention and MLP, final norm,
LM head. A layer's attention is Llama-family GQA (`LlamaAttention`) or Multi-head Latent
Attention (`MLAttention`); its MLP is dense (`DenseMLP`) or sparse (`SparseMoE`), as the config
says. The model file reads like the papers; every computation is a named op in `kernels`.

Weights are plain tensors: the engine never trains, so there is no autograd state to carry.

Across a group of ranks (`Parallel`) every layer holds its rank's share and ends in one
all-reduce, so every rank holds the whole hidden state between layers and `forward` returns it
whole on every rank. The embedding and the LM head are split by vocabulary
(`sharding.vocab_share`): a rank embeds the tokens of its share (zero rows for the others) and an
all-reduce sums them; its logits of its share are gathered from every rank into the full
vocabulary.

Under data-parallel attention a rank's forward sees its own sequences' tokens only: attention,
dense MLPs and vocabulary are whole on every rank, and only the sparse layers exchange tokens
(`idle` is a step without tokens of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels as ops
from inference.distributed.parallel import Parallel
from inference.distributed.sharding import Slices, vocab_share
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

    def __init__(
        self, config: ModelConfig, index: int, dtype: torch.dtype, parallel: Parallel
    ) -> None:
        hidden = config.hidden_size
        self.input_norm = torch.ones(hidden, dtype=dtype)
        self.post_attention_norm = torch.ones(hidden, dtype=dtype)
        attention = MLAttention if config.mla is not None else LlamaAttention
        self.attention = attention(config, dtype, parallel.dense())
        if config.moe is not None and config.moe.is_sparse(index):
            self.mlp = SparseMoE(config.moe, hidden, dtype, parallel)
        else:
            self.mlp = DenseMLP(hidden, config.intermediate_size, dtype, parallel.dense())


_ONE_DEVICE = Parallel.single()


class DecoderModel:
    """Embedding, decoder layers, final norm and LM head: on one device, or the share of one
    rank of `parallel` (whose KV cache is shaped by `kv_config`)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_positions: int,
        parallel: Parallel = _ONE_DEVICE,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.parallel = parallel
        self.kv_config = config.for_rank(parallel)
        # The vocabulary is split like the attention: not at all under data-parallel attention.
        self.vocab_parallel = parallel.dense()
        self.vocab = vocab_share(config.vocab_size, self.vocab_parallel)
        # Zeros: a padded share's rows past the vocabulary embed and score nothing.
        self.embed_tokens = torch.zeros(self.vocab.size, config.hidden_size, dtype=dtype)
        self.layers = [
            DecoderLayer(config, index, dtype, parallel) for index in range(config.num_layers)
        ]
        self.sparse_layers = [
            layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)
        ]
        self.norm = torch.ones(config.hidden_size, dtype=dtype)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else torch.zeros(self.vocab.size, config.hidden_size, dtype=dtype)
        )
        self.cos_cache, self.sin_cache = ops.build_cos_sin_cache(
            config.inv_freq, max_positions, config.attention_scaling
        )

    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, kv_caches: list
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for the flattened batch `input_ids`
        (whole on every rank); `kv_caches` holds each layer's cache
        (`inference.engine.kv_cache.layer_caches`, shaped by `kv_config`)."""
        hidden = self._embed(input_ids)
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

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.vocab_parallel.distributed:
            return self.embed_tokens.index_select(0, input_ids)
        local = input_ids - self.vocab.start
        elsewhere = (local < 0) | (local >= self.vocab.stop - self.vocab.start)
        rows = self.embed_tokens.index_select(0, local.masked_fill(elsewhere, 0))
        return self.vocab_parallel.all_reduce(rows.masked_fill_(elsewhere.unsqueeze(1), 0))

    def idle(self) -> None:
        """A step in which this rank has no token of its own (data-parallel attention): it only
        takes part in each sparse layer's exchange, so that the other ranks' tokens reach its
        experts and come back."""
        for mlp in self.sparse_layers:
            mlp.forward(torch.empty(0, self.config.hidden_size, dtype=self.dtype))

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token rotary tables for one step, shared by every layer."""
        return ops.rotary_cos_sin(self.cos_cache, self.sin_cache, positions, self.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the rows of `hidden` that sample a token (the whole
        vocabulary on every rank: each rank's share gathered, the padding cut off)."""
        logits = ops.linear(hidden, self.lm_head).float()
        if not self.vocab_parallel.distributed:
            return logits
        logits = self.vocab_parallel.all_gather(logits)
        vocab_size = self.config.vocab_size
        return logits if logits.shape[1] == vocab_size else logits[:, :vocab_size].contiguous()

    def load(self, checkpoint: Checkpoint) -> None:
        """Read a checkpoint's weights (Hugging Face names, `model.` prefix removed): this rank's
        share of each (`Parallel.single()`: the whole)."""
        family = self.config.architecture
        vocab = Slices.of(0, (self.vocab.start, self.vocab.stop))
        rows = self.vocab.stop - self.vocab.start
        self.embed_tokens[:rows].copy_(checkpoint.take("embed_tokens.weight", part=vocab))
        self.norm.copy_(checkpoint.take("norm.weight"))
        if not self.config.tie_word_embeddings:
            self.lm_head[:rows].copy_(checkpoint.take("lm_head.weight", part=vocab))
        else:
            # A tied checkpoint may store the head too: the same weights, left unread.
            checkpoint.discard("lm_head.weight")
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

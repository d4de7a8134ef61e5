"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2/K2.5) over a paged latent cache.

Each token's keys and values are decompressed from a latent c = RMSNorm(W_DKV · x) of
`kv_lora_rank` values; its rope key kr (`qk_rope_head_dim` values) is shared by every head. The
cache stores [c | kr] once per token and layer, not per-head keys and values
(`ModelConfig.kv_cache_shape`): for DeepSeek-V3, 576 values instead of 128 heads × 320.

- Decode runs in the absorbed form: with W_UKV = kv_b_proj split per head into W_UK (keys) and
  W_UV (values), q·k = (W_UKᵀ q_nope)·c + q_rope·kr, so the query is folded into latent space
  once, attention reads the latent cache directly (`ops.mla_decode`), and W_UV is applied to its
  output.
- Prefill decompresses its context (the new tokens and any cached prefix) with kv_b_proj and runs
  ordinary attention (`ops.mla_prefill`): over many queries that is cheaper than the absorbed
  form's kv_lora_rank-wide scores.

The rope dimensions are rotated in DeepSeek's interleaved pairs (`rope_interleave`), the softmax
scale carries YaRN's mscale squared (`MLAConfig.softmax_scale`).

Across a group of ranks the heads are split: q_proj (or q_b_proj), kv_b_proj and so W_UK and W_UV
hold this rank's heads, o_proj their columns (row-parallel, one all-reduce; its bias added by
rank 0 only). The latent path (kv_a_proj, q_a_proj and their norms) is replicated, and so is the
latent cache: every rank stores the whole [c | kr] row its heads all read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import kernels as ops
from inference.distributed.parallel import Parallel
from inference.distributed.sharding import Slices
from inference.models.checkpoint import Checkpoint
from inference.models.mlp import pack_projection
from inference.models.model_config import ModelConfig

if TYPE_CHECKING:
    from inference.models.decoder import ForwardBatch


class MLAttention:
    """One layer's MLA weights (this rank's heads) and its forward over the latent cache
    [blocks, block_size, R+P]."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, parallel: Parallel) -> None:
        mla = config.mla
        self.config, self.mla, self.parallel = config, mla, parallel
        self.head_share = parallel.share(config.num_heads, "attention heads")
        self.num_heads = heads = self.head_share[1] - self.head_share[0]
        hidden = config.hidden_size
        rank, rope = mla.kv_lora_rank, mla.qk_rope_head_dim
        bias = config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = torch.empty(heads * mla.qk_head_dim, hidden, dtype=dtype)
        else:
            self.q_a_proj = torch.empty(mla.q_lora_rank, hidden, dtype=dtype)
            self.q_a_bias = torch.zeros(mla.q_lora_rank, dtype=dtype) if bias else None
            self.q_a_norm = torch.ones(mla.q_lora_rank, dtype=dtype)
            self.q_b_proj = torch.empty(heads * mla.qk_head_dim, mla.q_lora_rank, dtype=dtype)
        self.kv_a_proj = torch.empty(rank + rope, hidden, dtype=dtype)
        self.kv_a_bias = torch.zeros(rank + rope, dtype=dtype) if bias else None
        self.kv_a_norm = torch.ones(rank, dtype=dtype)
        self.kv_b_proj = torch.empty(
            heads * (mla.qk_nope_head_dim + mla.v_head_dim), rank, dtype=dtype
        )
        self.o_proj = torch.empty(hidden, heads * mla.v_head_dim, dtype=dtype)
        # Added once to the all-reduced sum: by rank 0.
        self.o_bias = torch.zeros(hidden, dtype=dtype) if bias and parallel.rank == 0 else None
        # The absorbed decode's per-head halves of kv_b_proj (`absorb` fills them after load).
        self.w_uk = torch.empty(heads, mla.qk_nope_head_dim, rank, dtype=dtype)
        self.w_uv_t = torch.empty(heads, rank, mla.v_head_dim, dtype=dtype)

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, cache: torch.Tensor
    ) -> torch.Tensor:
        config, mla = self.config, self.mla
        eps, heads = config.rms_norm_eps, self.num_heads
        num_tokens = hidden.shape[0]
        q = self._query(hidden).view(num_tokens, heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        kv = ops.linear(hidden, self.kv_a_proj, self.kv_a_bias)
        latent, k_rope = kv.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent, _ = ops.rms_norm(latent.contiguous(), self.kv_a_norm, eps)
        k_rope = k_rope.unsqueeze(1)
        ops.rotary(q_rope, k_rope, batch.rotary_cos, batch.rotary_sin, mla.rope_interleave)
        ops.store_latent(latent, k_rope[:, 0], cache, batch.slot_mapping)
        num_decode = batch.attention.num_decode
        parts = []
        if num_decode:
            parts.append(self._decode(q_nope[:num_decode], q_rope[:num_decode], cache, batch))
        if num_decode < num_tokens:
            parts.append(self._prefill(q[num_decode:], latent, k_rope[:, 0], cache, batch))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.parallel.all_reduce(ops.linear(out, self.o_proj, self.o_bias))

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            return ops.linear(hidden, self.q_proj)
        q_a = ops.linear(hidden, self.q_a_proj, self.q_a_bias)
        q_a, _ = ops.rms_norm(q_a, self.q_a_norm, self.config.rms_norm_eps)
        return ops.linear(q_a, self.q_b_proj)

    def _decode(self, q_nope, q_rope, cache, batch: ForwardBatch) -> torch.Tensor:
        """The absorbed form: q_nope into latent space, attention over [c | kr], W_UV after."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        out_latent = ops.mla_decode(
            q_latent, q_rope.contiguous(), cache, batch.attention, self.mla.softmax_scale
        )
        out = torch.bmm(out_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1)
        return out.reshape(out.shape[0], -1)

    def _prefill(self, query, latent, k_rope, cache, batch: ForwardBatch) -> torch.Tensor:
        """Decompress each prefill's context (its new tokens, or its cached prefix and new tokens
        read back from the cache) and attend ordinarily."""
        mla, heads = self.mla, self.num_heads
        attention = batch.attention
        rank = mla.kv_lora_rank
        flat_cache = cache.view(-1, cache.shape[-1])
        latents, ropes, key_lens, query_lens = [], [], [], []
        for seg in attention.prefills:
            if seg.slots is None:
                rows = slice(seg.query_start, seg.query_start + seg.query_len)
                latents.append(latent[rows])
                ropes.append(k_rope[rows])
            else:
                context = flat_cache.index_select(0, seg.slots)
                latents.append(context[:, :rank])
                ropes.append(context[:, rank:])
            key_lens.append(seg.context_len)
            query_lens.append(seg.query_len)
        context_latent = latents[0] if len(latents) == 1 else torch.cat(latents)
        context_rope = ropes[0] if len(ropes) == 1 else torch.cat(ropes)
        num_keys = context_latent.shape[0]
        kv = ops.linear(context_latent, self.kv_b_proj).view(num_keys, heads, -1)
        k_nope, value = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        key = torch.cat([k_nope, context_rope.unsqueeze(1).expand(-1, heads, -1)], dim=-1)
        device = query.device
        out = ops.mla_prefill(
            query.contiguous(),
            key,
            value.contiguous(),
            _start_locations(query_lens, device),
            _start_locations(key_lens, device),
            mla.softmax_scale,
        )
        return out.reshape(query.shape[0], -1)

    def load(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Read the replicated latent projections and norms whole, and this rank's heads of
        q_proj (or q_b_proj), kv_b_proj and o_proj."""
        mla, (first, last) = self.mla, self.head_share

        def heads_of(name: str, per_head: int, dim: int = 0) -> torch.Tensor:
            part = Slices.of(dim, (first * per_head, last * per_head))
            return checkpoint.take(prefix + name, part=part)

        take = checkpoint.take
        if mla.q_lora_rank is None:
            self.q_proj.copy_(heads_of("q_proj.weight", mla.qk_head_dim))
        else:
            self.q_a_proj.copy_(take(prefix + "q_a_proj.weight"))
            self.q_a_norm.copy_(take(prefix + "q_a_layernorm.weight"))
            self.q_b_proj.copy_(heads_of("q_b_proj.weight", mla.qk_head_dim))
            if self.q_a_bias is not None:
                self.q_a_bias.copy_(take(prefix + "q_a_proj.bias"))
        self.kv_a_proj.copy_(take(prefix + "kv_a_proj_with_mqa.weight"))
        if self.kv_a_bias is not None:
            self.kv_a_bias.copy_(take(prefix + "kv_a_proj_with_mqa.bias"))
        self.kv_a_norm.copy_(take(prefix + "kv_a_layernorm.weight"))
        self.kv_b_proj.copy_(heads_of("kv_b_proj.weight", mla.qk_nope_head_dim + mla.v_head_dim))
        self.o_proj.copy_(heads_of("o_proj.weight", mla.v_head_dim, dim=1))
        if self.o_bias is not None:
            self.o_bias.copy_(take(prefix + "o_proj.bias"))
        elif self.config.attention_bias:
            checkpoint.discard(prefix + "o_proj.bias")  # rank 0 reads it
        self._absorb()

    def _absorb(self) -> None:
        mla, heads = self.mla, self.num_heads
        per_head = self.kv_b_proj.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, -1)
        w_uk, w_uv = per_head.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        self.w_uk.copy_(w_uk)
        self.w_uv_t.copy_(w_uv.transpose(1, 2))

    def pack(self, quantization: str | None) -> None:
        """Pack the projections; kv_b_proj stays dense (the absorbed halves are copies of it)."""
        names = ["kv_a_proj", "o_proj", "kv_b_proj"]
        names += ["q_proj"] if self.mla.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
        for name in names:
            quant = None if name == "kv_b_proj" else quantization
            setattr(self, name, pack_projection(getattr(self, name), quant))


def _start_locations(lengths: list[int], device) -> torch.Tensor:
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return starts.to(device)

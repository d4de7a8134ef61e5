"""The sparse MLP of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3: a router picks `top_k` of
the routed experts per token, the experts run through `ops.fused_moe` (the grouped Triton GEMM on
a GPU, an expert-grouped reference on the CPU: pairs sorted by expert, one matmul per expert that
received tokens), and shared experts, when the family has them, see every token.

Routing follows each family's oracle: softmax top-k over router logits computed in the model's
dtype (Mixtral always renormalises, the Qwen MoEs when `norm_topk_prob`), or DeepSeek-V3's
grouped top-k on sigmoid scores in float32 with the correction bias used only to choose, the
weights renormalised and scaled by `routed_scaling_factor`. Qwen2-MoE gates its shared expert by
sigmoid(gate · x).
"""

from __future__ import annotations

import torch

import kernels as ops
from inference.models.checkpoint import Checkpoint
from inference.models.mlp import DenseMLP
from inference.models.model_config import MoEConfig


class SparseMoE:
    """One layer's router, routed experts ([E, 2I, H] gate|up and [E, H, I] down) and shared
    expert; counts the tokens each expert received (`expert_tokens` since load,
    `last_step_tokens` in the last forward, which is one engine step)."""

    def __init__(self, moe: MoEConfig, hidden_size: int, dtype: torch.dtype) -> None:
        self.moe = moe
        experts, inter = moe.num_experts, moe.intermediate_size
        router_dtype = torch.float32 if moe.router_fp32 else dtype
        self.router = torch.empty(experts, hidden_size, dtype=router_dtype)
        self.correction_bias = (
            torch.zeros(experts, dtype=torch.float32) if moe.correction_bias else None
        )
        self.w13 = torch.empty(experts, 2 * inter, hidden_size, dtype=dtype)
        self.w2 = torch.empty(experts, hidden_size, inter, dtype=dtype)
        self.shared = (
            DenseMLP(hidden_size, moe.shared_intermediate_size, dtype)
            if moe.shared_intermediate_size
            else None
        )
        self.shared_gate = (
            torch.empty(1, hidden_size, dtype=dtype) if moe.shared_expert_gate else None
        )
        self.expert_tokens = torch.zeros(experts, dtype=torch.long)
        self.last_step_tokens = torch.zeros(experts, dtype=torch.long)  # one forward is one step

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        logits = ops.linear(hidden.to(self.router.dtype), self.router)
        weights, experts = ops.select_experts(
            logits,
            moe.top_k,
            moe.renormalize,
            scoring=moe.scoring,
            correction_bias=self.correction_bias,
            num_expert_group=moe.num_expert_group,
            topk_group=moe.topk_group,
            routed_scaling_factor=moe.routed_scaling_factor,
        )
        self.last_step_tokens = torch.bincount(experts.flatten().long(), minlength=moe.num_experts)
        self.expert_tokens += self.last_step_tokens
        if not moe.router_fp32:
            # Mixtral and the Qwen MoEs weigh the experts in the model's dtype.
            weights = weights.to(hidden.dtype).float()
        out = ops.fused_moe(hidden, self.w13, self.w2, weights, experts)
        if self.shared is not None:
            shared = self.shared.forward(hidden)
            if self.shared_gate is not None:
                shared = torch.sigmoid(ops.linear(hidden, self.shared_gate)) * shared
            out = out + shared
        return out

    def load(self, checkpoint: Checkpoint, prefix: str, family: str) -> None:
        """Copy the router, the experts (one tensor per expert on disk, stacked here) and the
        shared expert; names as each family's checkpoints have them."""
        take = checkpoint.take
        if family == "mixtral":
            router, expert_names, shared = "gate.weight", ("w1", "w3", "w2"), None
        else:
            router, expert_names = "gate.weight", ("gate_proj", "up_proj", "down_proj")
            shared = "shared_expert." if family == "qwen2_moe" else "shared_experts."
        self.router.copy_(take(prefix + router))
        if self.correction_bias is not None:
            self.correction_bias.copy_(take(prefix + "gate.e_score_correction_bias"))
        if checkpoint.has(prefix + "experts.gate_up_proj"):
            # Stacked as transformers writes them (a GGUF converted through it): [E, 2I, H].
            self.w13.copy_(take(prefix + "experts.gate_up_proj"))
            self.w2.copy_(take(prefix + "experts.down_proj"))
        else:
            self._load_each_expert(checkpoint, prefix, expert_names)
        if self.shared is not None:
            self.shared.load(checkpoint, prefix + shared)
        if self.shared_gate is not None:
            self.shared_gate.copy_(take(prefix + "shared_expert_gate.weight"))

    def _load_each_expert(self, checkpoint: Checkpoint, prefix: str, names) -> None:
        """One tensor per expert and projection, as published checkpoints hold them."""
        take = checkpoint.take
        gate, up, down = names
        for expert in range(self.moe.num_experts):
            base = f"{prefix}experts.{expert}."
            self.w13[expert].copy_(
                torch.cat([take(f"{base}{gate}.weight"), take(f"{base}{up}.weight")], dim=0)
            )
            self.w2[expert].copy_(take(f"{base}{down}.weight"))

    def pack(self, quantization: str | None) -> None:
        """The routed experts stay [E, …] tensors for `fused_moe`; the shared expert packs as a
        dense MLP."""
        if self.shared is not None:
            self.shared.pack(quantization)

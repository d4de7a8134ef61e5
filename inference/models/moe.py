"""The sparse MLP of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3: a router picks `top_k` of
the routed experts per token, the experts run through `ops.fused_moe` (the grouped Triton GEMM on
a GPU, an expert-grouped reference on the CPU: pairs sorted by expert, one matmul per expert that
received tokens), and shared experts, when the family has them, see every token.

Routing follows each family's oracle: softmax top-k over router logits computed in the model's
dtype (Mixtral always renormalises, the Qwen MoEs when `norm_topk_prob`), or DeepSeek-V3's
grouped top-k on sigmoid scores in float32 with the correction bias used only to choose, the
weights renormalised and scaled by `routed_scaling_factor`. Qwen2-MoE gates its shared expert by
sigmoid(gate · x).

Across a group of ranks the router and the correction bias are replicated, so every rank
computes the same routing (and counts every expert's tokens). With `expert_parallel` 1 each
routed expert is split by its intermediate size like a dense MLP; with `expert_parallel` = world
size a rank holds a contiguous share of whole experts and runs only the (token, choice) pairs
routed to them. The shared expert is split like a dense MLP either way. Every rank's output is a
partial sum (its experts' or its intermediate share's, plus its share of the shared expert), and
one all-reduce combines them.

Under data-parallel attention (experts spread, each rank serving its own sequences) the pairs go
to the rank holding their expert and their outputs come back, by all-to-all (`_dispatched`); the
shared expert is whole on every rank and no all-reduce follows.
"""

from __future__ import annotations

import torch

import kernels as ops
from inference.distributed.parallel import Parallel
from inference.distributed.sharding import Slices, expert_intermediate_share, expert_share
from inference.models.checkpoint import Checkpoint
from inference.models.mlp import DenseMLP
from inference.models.model_config import MoEConfig


class SparseMoE:
    """One layer's router, routed experts ([E, 2I, H] gate|up and [E, H, I] down: this rank's
    experts [first, last) and its share of their intermediate size) and shared expert; counts the
    tokens each expert received (`expert_tokens` since load, `last_step_tokens` in the last
    forward, which is one engine step)."""

    def __init__(
        self,
        moe: MoEConfig,
        hidden_size: int,
        dtype: torch.dtype,
        parallel: Parallel,
    ) -> None:
        self.moe, self.parallel = moe, parallel
        self.expert_range = expert_share(moe.num_experts, parallel)
        self.intermediate_share = expert_intermediate_share(moe.intermediate_size, parallel)
        experts = self.expert_range[1] - self.expert_range[0]
        inter = self.intermediate_share[1] - self.intermediate_share[0]
        router_dtype = torch.float32 if moe.router_fp32 else dtype
        self.router = torch.empty(moe.num_experts, hidden_size, dtype=router_dtype)
        self.correction_bias = (
            torch.zeros(moe.num_experts, dtype=torch.float32) if moe.correction_bias else None
        )
        self.w13 = torch.empty(experts, 2 * inter, hidden_size, dtype=dtype)
        self.w2 = torch.empty(experts, hidden_size, inter, dtype=dtype)
        self.shared = (
            DenseMLP(hidden_size, moe.shared_intermediate_size, dtype, parallel.dense())
            if moe.shared_intermediate_size
            else None
        )
        self.shared_gate = (
            torch.empty(1, hidden_size, dtype=dtype) if moe.shared_expert_gate else None
        )
        self.expert_tokens = torch.zeros(moe.num_experts, dtype=torch.long)
        # One forward is one step.
        self.last_step_tokens = torch.zeros(moe.num_experts, dtype=torch.long)

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
        dispatch = self.parallel.data_parallel_attention and self.parallel.distributed
        out = (self._dispatched if dispatch else self._routed)(hidden, weights, experts)
        if self.shared is not None:
            shared = self.shared.partial_forward(hidden)
            if self.shared_gate is not None:
                shared = ops.sigmoid(ops.linear(hidden, self.shared_gate)) * shared
            out = out + shared
        # Dispatched, `out` is already whole: each token's experts' outputs came back to it.
        return out if dispatch else self.parallel.all_reduce(out)

    def _routed(
        self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' output, or with expert parallelism this rank's experts' part."""
        first, last = self.expert_range
        if last - first == self.moe.num_experts:
            return ops.fused_moe(hidden, self.w13, self.w2, weights, experts)
        # Only the (token, choice) pairs routed here, one pair a row: a token choosing two of
        # this rank's experts is two rows, summed back into its own.
        tokens, choices = ((experts >= first) & (experts < last)).nonzero(as_tuple=True)
        out = torch.zeros_like(hidden)
        if tokens.numel():
            pairs = ops.fused_moe(
                hidden.index_select(0, tokens),
                self.w13,
                self.w2,
                weights[tokens, choices].unsqueeze(1),
                (experts[tokens, choices] - first).unsqueeze(1),
            )
            out.index_add_(0, tokens, pairs)
        return out

    def _dispatched(
        self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' output for this rank's own tokens, under data-parallel attention:
        each (token, choice) pair goes to the rank holding its expert (one all-to-all of the
        pairs' expert and weight, one of their hidden rows), that rank runs its experts on every
        pair it received, and the weighted outputs come back (a third all-to-all) to be summed
        into their tokens. Every rank takes part in every exchange, with or without tokens."""
        parallel, top_k = self.parallel, experts.shape[1]
        per_rank = self.expert_range[1] - self.expert_range[0]
        # Pairs in the order of the rank that holds their expert (stable: token order within).
        flat = experts.flatten().long()
        owner = flat // per_rank
        order = torch.argsort(owner, stable=True)
        tokens = order // top_k
        send = torch.bincount(owner, minlength=parallel.world_size)
        receive = parallel.all_to_all(send, [1] * parallel.world_size, [1] * parallel.world_size)
        send_counts, receive_counts = send.tolist(), receive.tolist()
        # The expert (this rank's numbering on the receiving side) and the weight of each pair.
        routing = torch.stack(
            [(flat[order] % per_rank).float(), weights.flatten()[order].float()], dim=1
        )
        routing = parallel.all_to_all(routing, send_counts, receive_counts)
        rows = parallel.all_to_all(hidden.index_select(0, tokens), send_counts, receive_counts)
        if rows.shape[0]:
            rows = ops.fused_moe(rows, self.w13, self.w2, routing[:, 1:], routing[:, :1].long())
        back = parallel.all_to_all(rows, receive_counts, send_counts)
        return torch.zeros_like(hidden).index_add_(0, tokens, back)

    def load(self, checkpoint: Checkpoint, prefix: str, family: str) -> None:
        """Read the router, this rank's experts or share of every expert (one tensor per expert
        on disk, stacked here) and the shared expert; names as each family's checkpoints have
        them."""
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
            self._load_stacked(checkpoint, prefix)
        else:
            self._load_each_expert(checkpoint, prefix, expert_names)
        if self.shared is not None:
            self.shared.load(checkpoint, prefix + shared)
        if self.shared_gate is not None:
            self.shared_gate.copy_(take(prefix + "shared_expert_gate.weight"))

    def _load_stacked(self, checkpoint: Checkpoint, prefix: str) -> None:
        """Experts stacked as transformers writes them: gate_up_proj [E, 2I, H], down_proj
        [E, H, I]; this rank's experts, or the gate and up rows and down columns of its share."""
        if self.parallel.expert_parallel > 1:
            gate_up = down = Slices.of(0, self.expert_range)
        else:
            start, stop = self.intermediate_share
            inter = self.moe.intermediate_size
            gate_up = Slices.of(1, (start, stop), (inter + start, inter + stop))
            down = Slices.of(2, (start, stop))
        self.w13.copy_(checkpoint.take(prefix + "experts.gate_up_proj", part=gate_up))
        self.w2.copy_(checkpoint.take(prefix + "experts.down_proj", part=down))

    def _load_each_expert(self, checkpoint: Checkpoint, prefix: str, names) -> None:
        """One tensor per expert and projection, as published checkpoints hold them; another
        rank's experts are left unread."""
        take = checkpoint.take
        gate, up, down = names
        first, last = self.expert_range
        rows, columns = Slices.of(0, self.intermediate_share), Slices.of(1, self.intermediate_share)
        for expert in range(self.moe.num_experts):
            base = f"{prefix}experts.{expert}."
            if not first <= expert < last:
                checkpoint.discard(base)
                continue
            gate_up = [
                take(f"{base}{gate}.weight", part=rows),
                take(f"{base}{up}.weight", part=rows),
            ]
            self.w13[expert - first].copy_(torch.cat(gate_up, dim=0))
            self.w2[expert - first].copy_(take(f"{base}{down}.weight", part=columns))

    def pack(self, quantization: str | None) -> None:
        """The routed experts stay [E, …] tensors for `fused_moe`; the shared expert packs as a
        dense MLP."""
        if self.shared is not None:
            self.shared.pack(quantization)

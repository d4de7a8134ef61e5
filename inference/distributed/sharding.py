"""Which part of each weight one rank holds: the slicing rules of tensor and expert parallelism.

Megatron-style, every share contiguous:
- attention is split by heads: a rank keeps its query heads and the KV heads they read; with
  fewer KV heads than ranks, each KV head is replicated on the ranks whose query heads use it
  (rank r keeps KV head r * num_kv_heads // world);
- a dense MLP (and a routed expert, when experts are not spread) is split by its intermediate
  size: the gate and up rows of the share, the same columns of down;
- the vocabulary is split in shares of ceil(vocab / world) rows; the last share is padded with
  zero rows when the vocabulary does not divide (their logits are cut off after the gather);
- with expert parallelism each rank holds a contiguous share of whole experts.

The model's layers ask these functions for their shares, and `Slices` says which rows or columns
of a checkpoint tensor a rank reads (`Checkpoint.take`), so no rank reads what it does not keep.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.distributed.parallel import Parallel
from inference.protocol.kv_layout import rank_kv_heads


@dataclass(frozen=True)
class Slices:
    """Ranges [start, stop) along dimension `dim` of a tensor, read and concatenated in order
    (two ranges: the gate and the up share of a stacked [gate | up] weight)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, dim: int, *ranges: tuple[int, int]) -> Slices:
        return cls(dim, tuple(ranges))


@dataclass(frozen=True)
class AttentionHeads:
    """One rank's query heads [q_start, q_stop) and KV heads [kv_start, kv_stop)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start


def attention_heads(num_heads: int, num_kv_heads: int, parallel: Parallel) -> AttentionHeads:
    """The heads `parallel`'s rank computes: an even share of the query heads and of the KV
    heads, or, with fewer KV heads than ranks, the one KV head its query heads read."""
    q_start, q_stop = parallel.share(num_heads, "attention heads")
    # The wire protocol's rule: a peer maps our cache's heads by it (kv_layout.head_routes).
    kv_start, kv_stop = rank_kv_heads(num_kv_heads, parallel.world_size, parallel.rank)
    return AttentionHeads(q_start, q_stop, kv_start, kv_stop)


@dataclass(frozen=True)
class VocabShare:
    """One rank's vocabulary rows [start, stop) of an embedding (or LM head) it holds as `size`
    rows: every share has the same size, the last ones padded past the vocabulary."""

    start: int
    stop: int
    size: int


def vocab_share(vocab_size: int, parallel: Parallel) -> VocabShare:
    """Shares of ceil(vocab / world) rows, the last padded rather than the split refused."""
    size = -(-vocab_size // parallel.world_size)
    start = min(parallel.rank * size, vocab_size)
    return VocabShare(start, min(start + size, vocab_size), size)


def expert_share(num_experts: int, parallel: Parallel) -> tuple[int, int]:
    """The routed experts [start, stop) this rank holds: all of them unless experts are spread
    across the ranks (`expert_parallel` = world size)."""
    if parallel.expert_parallel == 1:
        return 0, num_experts
    return parallel.share(num_experts, "routed experts")


def expert_intermediate_share(intermediate_size: int, parallel: Parallel) -> tuple[int, int]:
    """The part [start, stop) of each held routed expert's intermediate size this rank computes:
    a tensor-parallel share when experts are not spread, else the whole expert."""
    if parallel.expert_parallel > 1:
        return 0, intermediate_size
    return parallel.share(intermediate_size, "expert intermediate size")

"""How one model is split across the ranks of a group, and the collectives its layers call.

A group of `world_size` ranks (processes, one device each) serves one model as one node:
- tensor parallelism over all the ranks (`tensor_parallel` = world size): attention heads, the
  dense MLP's intermediate size, and the vocabulary (embedding and LM head) are split in
  contiguous shares; each layer's attention and MLP end in one all-reduce of the hidden states,
  so every rank holds the whole hidden state between layers;
- expert parallelism (`expert_parallel`: 1, or the world size): with 1, each routed expert is
  split like a dense MLP (by its intermediate size); with the world size, each rank holds a
  contiguous share of whole experts, runs them on the tokens routed to them, and the same
  all-reduce combines the shares. Routing is computed on every rank from the same hidden state
  and weights, so every rank makes the same choice;
- data-parallel attention (`data_parallel_attention`, DeepSeek's serving layout; experts spread
  across every rank): each rank holds the attention, the dense MLPs, the shared experts and the
  vocabulary whole and runs them on its own sequences only (their KV is in its cache alone);
  the tokens each rank routes to another rank's experts go there and their outputs come back by
  all-to-all (moe.py). Between layers a rank holds the hidden state of its own tokens.

`Parallel.single()` is the one-device case: every share is the whole, every collective returns
its input unchanged, so the model code reads the same with or without a group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    world_size: int = 1
    expert_parallel: int = 1
    group: Any = None  # the torch.distributed process group; None: the default one
    data_parallel_attention: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")
        if self.expert_parallel not in (1, self.world_size):
            raise ValueError(
                f"expert parallelism must be 1 or the world size ({self.world_size}), "
                f"got {self.expert_parallel}"
            )

    @classmethod
    def single(cls) -> Parallel:
        return cls()

    @property
    def tensor_parallel(self) -> int:
        return self.world_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def dense(self) -> Parallel:
        """How the attention, the dense MLPs, the shared experts and the vocabulary are split:
        across the group (tensor-parallel attention), or not at all (data-parallel attention:
        every rank holds them whole, so their collectives are no-ops)."""
        return _ONE_DEVICE if self.data_parallel_attention else self

    def all_to_all(
        self, tensor: torch.Tensor, send_counts: list[int], receive_counts: list[int]
    ) -> torch.Tensor:
        """Rows of `tensor` sent to each rank in rank order (`send_counts[r]` rows to rank r),
        and the rows every rank sent here, in rank order (`receive_counts[r]` from rank r)."""
        if not self.distributed:
            return tensor
        out = tensor.new_empty((sum(receive_counts), *tensor.shape[1:]))
        dist.all_to_all_single(
            out, tensor.contiguous(), receive_counts, send_counts, group=self.group
        )
        return out

    def share(self, total: int, what: str = "dimension") -> tuple[int, int]:
        """This rank's contiguous share [start, stop) of `total` units split evenly across the
        ranks; a ValueError naming `what` when they do not split evenly."""
        if total % self.world_size:
            raise ValueError(f"{what} {total} does not split across {self.world_size} ranks")
        size = total // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over the ranks, in place (itself when alone)."""
        if self.distributed:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` concatenated along `dim` in rank order (itself when alone)."""
        if not self.distributed:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


_ONE_DEVICE = Parallel()

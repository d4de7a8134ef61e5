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
  and weights, so every rank makes the same choice.

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

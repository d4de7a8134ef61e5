"""What two nodes must agree on before one writes KV blocks into the other's cache.

A block written by a node whose cache is laid out otherwise (another dtype, block size, head
count, or another model's weights) would be read as garbage without any error, so every pair is
checked once (`KVPeers`) and refused with the fields that differ, never mixed.

The layout itself, and which layouts map between groups of ranks, is the wire protocol's
(inference/protocol/kv_layout.py): the gateway pairs nodes by the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference.protocol.kv_layout import HeadRoute, KVLayout, head_routes, layouts_pair

__all__ = ["HeadRoute", "KVLayout", "head_routes", "layouts_pair"]


class LayoutMismatchError(Exception):
    """Two nodes' KV caches are laid out differently; the message names every difference."""


@dataclass(frozen=True)
class RankBuffer:
    """One rank's cache for the transfer engine: its endpoint (host:rpc port) and the buffer's
    address there."""

    endpoint: str
    base: int


@dataclass(frozen=True)
class KVRegion:
    """Where a node's cache lies for the transfer engine: every rank's buffer (rank 0's first;
    one for a node of one rank), the block count (each rank's every layer's keys and values hold
    that many), and the layout."""

    ranks: tuple[RankBuffer, ...]
    num_blocks: int
    layout: KVLayout

    @property
    def endpoint(self) -> str:
        return self.ranks[0].endpoint

    @property
    def base(self) -> int:
        return self.ranks[0].base

    def as_dict(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "base": self.base,
            "ranks": [{"endpoint": r.endpoint, "base": r.base} for r in self.ranks],
            "num_blocks": self.num_blocks,
            "layout": self.layout.as_dict(),
        }

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> KVRegion:
        ranks = value.get("ranks") or [value]  # a node of one rank, as older nodes sent it
        region = cls(
            ranks=tuple(RankBuffer(str(r["endpoint"]), int(r["base"])) for r in ranks),
            num_blocks=int(value["num_blocks"]),
            layout=KVLayout.from_dict(value["layout"]),
        )
        if len(region.ranks) != region.layout.tensor_parallel:
            raise ValueError(
                f"{len(region.ranks)} rank buffers for tensor_parallel "
                f"{region.layout.tensor_parallel}"
            )
        return region

    def offset(self, layer: int, kind: int, block: int, rank: int = 0) -> int:
        """Address of block `block` of `layer`'s keys (kind 0) or values (kind 1), or latents
        (MLA's one kind), in rank `rank`'s buffer (inference.engine.kv_cache lays it out)."""
        index = (layer * self.layout.kinds + kind) * self.num_blocks + block
        return self.ranks[rank].base + index * self.layout.block_bytes


class KVPeers:
    """The layout check, once per peer: the first message from (or to) a peer compares its
    layout with ours; the verdict is kept for the peer's endpoint and buffer."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._verdicts: dict[tuple[str, int, KVLayout], str | None] = {}

    def check(self, peer: KVRegion) -> None:
        """Raise LayoutMismatchError naming what differs between `peer`'s layout and ours."""
        key = (peer.endpoint, peer.base, peer.layout)
        if key not in self._verdicts:
            self._verdicts[key] = self.layout.mismatch(peer.layout)
        problem = self._verdicts[key]
        if problem is not None:
            raise LayoutMismatchError(
                f"the KV cache of {peer.endpoint} is laid out otherwise: {problem} (here "
                f"{self.layout.describe()}; there {peer.layout.describe()})"
            )

    @property
    def num_peers(self) -> int:
        return len(self._verdicts)


def kv_layout_of(engine, model: str) -> KVLayout:
    """The layout of `engine`'s cache serving `model` (an LLMEngine; each rank's share of it in
    a group)."""
    config = engine.model_config.for_rank(engine.runner.parallel)
    kinds, heads, dim = config.kv_cache_shape
    return KVLayout(
        model=model,
        dtype={"bf16": "bfloat16", "fp32": "float32"}.get(engine.config.dtype, engine.config.dtype),
        block_size=engine.config.block_size,
        num_layers=config.num_layers,
        num_kv_heads=heads,
        head_dim=dim,
        kinds=kinds,
        tensor_parallel=engine.config.tensor_parallel,
        total_kv_heads=engine.model_config.kv_cache_shape[1],
    )

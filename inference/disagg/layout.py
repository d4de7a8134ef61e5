"""What two nodes must agree on before one writes KV blocks into the other's cache.

A block written by a node whose cache is laid out otherwise (another dtype, block size, head
count, or another model's weights) would be read as garbage without any error, so every pair is
checked once (`KVPeers`) and refused with the fields that differ, never mixed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class KVLayout:
    """The shape of a node's paged KV cache, as its heartbeats and prefill messages publish it."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kinds: int = 2  # keys and values; 1 for MLA's latent cache

    @property
    def element_bytes(self) -> int:
        return {"float32": 4, "fp32": 4}.get(self.dtype, 2)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's keys (or values, or latents)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_bytes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> KVLayout:
        fields = cls.__dataclass_fields__
        return cls(**{name: value[name] for name in fields if name in value or name != "kinds"})

    def mismatch(self, other: KVLayout) -> str | None:
        """None when blocks can move between the two caches, else the fields that differ."""
        differences = [
            f"{name} {mine!r} here, {theirs!r} there"
            for name, mine in asdict(self).items()
            if (theirs := getattr(other, name)) != mine and not _same_dtype(name, mine, theirs)
        ]
        return "; ".join(differences) or None


def _same_dtype(name: str, mine: Any, theirs: Any) -> bool:
    aliases = {"bf16": "bfloat16", "fp32": "float32"}
    return name == "dtype" and aliases.get(mine, mine) == aliases.get(theirs, theirs)


class LayoutMismatchError(Exception):
    """Two nodes' KV caches are laid out differently; the message names every difference."""


@dataclass(frozen=True)
class KVRegion:
    """Where a node's cache lies for the transfer engine: its endpoint (host:rpc port), the
    buffer's address there, its block count (each layer's keys and values hold that many), and
    its layout."""

    endpoint: str
    base: int
    num_blocks: int
    layout: KVLayout

    def as_dict(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "base": self.base,
            "num_blocks": self.num_blocks,
            "layout": self.layout.as_dict(),
        }

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> KVRegion:
        return cls(
            endpoint=str(value["endpoint"]),
            base=int(value["base"]),
            num_blocks=int(value["num_blocks"]),
            layout=KVLayout.from_dict(value["layout"]),
        )

    def offset(self, layer: int, kind: int, block: int) -> int:
        """Address of block `block` of `layer`'s keys (kind 0) or values (kind 1), or latents
        (MLA's one kind) (inference.engine.kv_cache lays the buffer out)."""
        index = (layer * self.layout.kinds + kind) * self.num_blocks + block
        return self.base + index * self.layout.block_bytes


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
                f"the KV cache of {peer.endpoint} is laid out otherwise: {problem}"
            )

    @property
    def num_peers(self) -> int:
        return len(self._verdicts)


def kv_layout_of(engine, model: str) -> KVLayout:
    """The layout of `engine`'s cache serving `model` (an LLMEngine)."""
    config = engine.model_config
    kinds, heads, dim = config.kv_cache_shape
    return KVLayout(
        model=model,
        dtype={"bf16": "bfloat16", "fp32": "float32"}.get(engine.config.dtype, engine.config.dtype),
        block_size=engine.config.block_size,
        num_layers=config.num_layers,
        num_kv_heads=heads,
        head_dim=dim,
        kinds=kinds,
    )

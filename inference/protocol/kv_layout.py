"""A node's KV cache layout as heartbeats and prefill messages publish it, and which layouts can
exchange blocks: torch-free, so the gateway pairs prefill and decode nodes by the same rules the
nodes check (inference/disagg/layout.py, which adds the checks that need an engine).

A node may be a group of ranks (docs/parallelism.md), each caching its share of the KV heads in a
buffer of its own. Blocks move rank to rank: a writer's rank fills the reader's ranks whose cache
holds exactly its heads (`reader_ranks`). That maps two groups of the same size (the same model
splits its heads the same way), and MLA's latent cache, which is whole on every rank, between
groups of any sizes. Anything else (a rank would hold only part of another rank's heads, which
are interleaved in every token's slot) is refused, naming both layouts.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class KVLayout:
    """The shape of a node's paged KV cache, as its heartbeats and prefill messages publish it:
    `num_kv_heads` is what each rank's cache holds (its share in a group of `tensor_parallel`
    ranks; MLA's one latent row on every rank)."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kinds: int = 2  # keys and values; 1 for MLA's latent cache
    tensor_parallel: int = 1

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
        fields = cls.__dataclass_fields__.items()
        # A missing field with a default is an older node's (one rank, keys and values).
        return cls(**{n: value[n] for n, f in fields if n in value or f.default is MISSING})

    @property
    def replicated(self) -> bool:
        """Whether every rank caches the whole KV row (MLA's latent), so that any rank of
        another group can fill any of ours."""
        return self.kinds == 1

    def describe(self) -> str:
        ranks = f"{self.tensor_parallel} rank(s) × " if self.tensor_parallel > 1 else ""
        return (
            f"{self.model} {self.dtype}, block {self.block_size}, {self.num_layers} layers, "
            f"{ranks}{self.kinds} kind(s) × {self.num_kv_heads} KV head(s) × {self.head_dim}"
        )

    def mismatch(self, other: KVLayout) -> str | None:
        """None when blocks can move between the two caches, else the fields that differ."""
        differences = [
            f"{name} {mine!r} here, {theirs!r} there"
            for name, mine in asdict(self).items()
            if name != "tensor_parallel"
            and (theirs := getattr(other, name)) != mine
            and not _same_dtype(name, mine, theirs)
        ]
        if self.tensor_parallel != other.tensor_parallel and not (
            self.replicated and other.replicated
        ):
            differences.append(
                f"tensor_parallel {self.tensor_parallel} here, {other.tensor_parallel} there "
                "(each rank caches its share of the KV heads: only groups of the same size, or "
                "MLA's latent cache, map rank to rank)"
            )
        return "; ".join(differences) or None


def reader_ranks(writer: KVLayout, reader: KVLayout, rank: int) -> list[int]:
    """The reader's ranks whose caches the writer's rank `rank` fills, for two layouts without a
    `mismatch`: reader rank j is filled by writer rank j mod the writer's size (rank i by rank i
    between groups of one size; with MLA, every reader rank by some writer rank)."""
    return [j for j in range(reader.tensor_parallel) if j % writer.tensor_parallel == rank]


def layouts_pair(writer: dict[str, Any] | None, reader: dict[str, Any] | None) -> bool:
    """Whether a node publishing `writer` as its `kv_layout` can fill the cache of one
    publishing `reader` (the gateway's check before it splits a request)."""
    if not writer or not reader:
        return False
    try:
        return KVLayout.from_dict(writer).mismatch(KVLayout.from_dict(reader)) is None
    except (KeyError, TypeError):
        return False


def _same_dtype(name: str, mine: Any, theirs: Any) -> bool:
    aliases = {"bf16": "bfloat16", "fp32": "float32"}
    return name == "dtype" and aliases.get(mine, mine) == aliases.get(theirs, theirs)

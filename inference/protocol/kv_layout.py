"""A node's KV cache layout as heartbeats and prefill messages publish it, and which layouts can
exchange blocks: torch-free, so the gateway pairs prefill and decode nodes by the same rules the
nodes check (inference/disagg/layout.py, which adds the checks that need an engine).

A node may be a group of ranks (docs/parallelism.md), each caching its share of the KV heads in a
buffer of its own (`rank_kv_heads`: an even share, or with fewer heads than ranks one head
replicated on several). Blocks move rank to rank (`head_routes`): each of the reader's heads is
written by the first of the writer's ranks that holds it, into every reader rank that holds it.
Between groups of the same size a rank fills the same rank with whole blocks; between groups of
different sizes a writer rank holds only part of a reader rank's heads, or more than them, and
since a block interleaves the heads in each token's slot, the write is one piece per token and
layer. MLA's latent cache is whole on every rank and moves as whole blocks between any sizes.
Layouts of different models, dtypes, block sizes, head counts or dimensions are refused, naming
both.
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
    total_kv_heads: int = 0  # the model's KV heads; 0: an older node's, num_kv_heads × ranks

    @property
    def model_kv_heads(self) -> int:
        """The KV heads of the whole model (MLA's one latent row)."""
        if self.replicated:
            return self.num_kv_heads
        return self.total_kv_heads or self.num_kv_heads * self.tensor_parallel

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
        """None when blocks can move between the two caches, else the fields that differ. How
        the groups split the heads does not matter (`head_routes` maps them); the model's KV
        heads do."""
        split = ("tensor_parallel", "num_kv_heads", "total_kv_heads")
        differences = [
            f"{name} {mine!r} here, {theirs!r} there"
            for name, mine in asdict(self).items()
            if name not in split
            and (theirs := getattr(other, name)) != mine
            and not _same_dtype(name, mine, theirs)
        ]
        if self.model_kv_heads != other.model_kv_heads:
            differences.append(f"KV heads {self.model_kv_heads} here, {other.model_kv_heads} there")
        return "; ".join(differences) or None


def rank_kv_heads(total: int, world: int, rank: int) -> tuple[int, int]:
    """The KV heads [start, stop) rank `rank` of `world` caches: an even share, or with fewer
    heads than ranks the one head its query heads read (head rank * total // world)."""
    if total >= world:
        if total % world:
            raise ValueError(f"{total} KV heads do not split across {world} ranks")
        share = total // world
        return rank * share, (rank + 1) * share
    if world % total:
        raise ValueError(f"{total} KV heads do not replicate evenly across {world} ranks")
    head = rank * total // world
    return head, head + 1


@dataclass(frozen=True)
class HeadRoute:
    """Part of a writer rank's cache that goes to one reader rank: `heads` consecutive KV heads,
    from the writer's head slot `src_head` to the reader's `dst_head` (slots within each token's
    row of the rank's cache). `whole` when that is the whole row on both sides (whole blocks
    move)."""

    target: int
    src_head: int
    dst_head: int
    heads: int
    whole: bool


def head_routes(writer: KVLayout, reader: KVLayout, rank: int) -> list[HeadRoute]:
    """Where writer rank `rank` writes, for two layouts without a `mismatch`: each reader head is
    written by the writer's lowest rank that holds it (a replicated head once), into every reader
    rank that holds it."""
    if writer.replicated:  # every rank's row is the whole latent: rank j from rank j mod size
        heads = writer.num_kv_heads
        return [
            HeadRoute(j, 0, 0, heads, True)
            for j in range(reader.tensor_parallel)
            if j % writer.tensor_parallel == rank
        ]
    total = writer.model_kv_heads
    holders = [
        rank_kv_heads(total, writer.tensor_parallel, r) for r in range(writer.tensor_parallel)
    ]
    mine = holders[rank]
    # The heads this rank writes: those no lower rank holds.
    first = max([mine[0], *(stop for start, stop in holders[:rank] if start <= mine[0] < stop)])
    routes = []
    for target in range(reader.tensor_parallel):
        start, stop = rank_kv_heads(total, reader.tensor_parallel, target)
        low, high = max(first, start), min(mine[1], stop)
        if low < high:
            whole = (low, high) == mine == (start, stop)
            routes.append(HeadRoute(target, low - mine[0], low - start, high - low, whole))
    return routes


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

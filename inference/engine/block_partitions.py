"""The KV blocks of a group serving with data-parallel attention: one pool per rank.

Under data-parallel attention (docs/parallelism.md) each rank computes the attention of its own
sequences over its own cache, so a sequence's blocks all live in one rank's cache, and a prefix
cached on one rank serves only sequences that run there. Rank 0 still decides everything: this
manager holds one `BlockManager` per rank (a sequence's `block_table` holds that pool's block
ids, `seq.partition` says which) and offers the scheduler the same calls as one pool.

A waiting sequence is placed when it is admitted (`match_prefix`): on the rank whose cache holds
the longest prefix of it, among equals the one with the most free blocks, which spreads new
sequences across the ranks. A preempted sequence is placed again when it is readmitted.
"""

from __future__ import annotations

from itertools import zip_longest

from inference.engine.block_manager import BlockManager
from inference.engine.sequence import Sequence


class PartitionedBlockManager:
    """`partitions` pools of `blocks_per_partition` blocks each, behind one pool's interface."""

    def __init__(
        self,
        partitions: int,
        blocks_per_partition: int,
        block_size: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [
            BlockManager(blocks_per_partition, block_size, enable_prefix_caching)
            for _ in range(partitions)
        ]

    def _pool(self, seq: Sequence) -> BlockManager:
        return self.pools[seq.partition]

    @property
    def num_blocks(self) -> int:
        return sum(pool.num_blocks for pool in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(pool.num_free_blocks for pool in self.pools)

    @property
    def num_held_blocks(self) -> int:
        return sum(pool.num_held_blocks for pool in self.pools)

    @property
    def max_sequence_blocks(self) -> int:
        return self.pools[0].num_blocks

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return sum(pool.prefix_cache_hit_tokens for pool in self.pools)

    @property
    def prefix_cache_query_tokens(self) -> int:
        return sum(pool.prefix_cache_query_tokens for pool in self.pools)

    def free_blocks_for(self, seq: Sequence) -> int:
        return self._pool(seq).num_free_blocks

    def shares_pool(self, seq: Sequence, other: Sequence) -> bool:
        return seq.partition == other.partition

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Place a waiting `seq` (the longest cached prefix, then the most free blocks) and
        return its hits there."""
        matches = [pool.match_prefix(seq) for pool in self.pools]
        seq.partition = max(
            range(len(self.pools)),
            key=lambda index: (len(matches[index]), self.pools[index].num_free_blocks, -index),
        )
        return matches[seq.partition]

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, hits: list[int] = ()) -> int:
        return self._pool(seq).blocks_needed(seq, num_new_tokens, hits)

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        self._pool(seq).admit(seq, hits)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, contiguous: bool = False) -> bool:
        return self._pool(seq).allocate_slots(seq, num_new_tokens, contiguous)

    def commit_computed_blocks(self, seq: Sequence) -> None:
        self._pool(seq).commit_computed_blocks(seq)

    def free(self, seq: Sequence) -> None:
        self._pool(seq).free(seq)

    def release_holds(self, now: float) -> int:
        return sum(pool.release_holds(now) for pool in self.pools)

    def cached_block_hashes(self, limit: int | None = None) -> list[bytes]:
        """Every rank's servable prefix hashes, each rank's first choices first (a heartbeat's
        digest: a prefix any rank holds can be served by this node)."""
        chosen = [pool.cached_block_hashes(limit) for pool in self.pools]
        interleaved = (h for row in zip_longest(*chosen) for h in row if h is not None)
        merged = list(dict.fromkeys(interleaved))
        return merged if limit is None else merged[:limit]

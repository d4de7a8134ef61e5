"""KV block allocation with prefix caching.

Blocks are reference counted. A block whose tokens are all computed is registered under its chain
hash (`block_hash`); when its last user frees it, it joins the free list but stays registered, so a
later request with the same prefix (and namespace) takes it back instead of recomputing it. The
free list is in LRU order: allocation evicts the block that was freed longest ago, and a sequence
frees its blocks tail first, so shared heads outlive private tails.

A hold (`hold`) keeps blocks out of the free list until a time has passed, whoever else frees
them: a decode node holds the blocks a prefill node may still write (disaggregated prefill) until
that write's deadline, so a late or duplicate write can only ever land in blocks nobody else owns.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from inference.engine.sequence import Sequence


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    """Owns the block pool of the paged KV cache and the prefix cache index."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}
        self.prefix_cache_hit_tokens = 0
        self.prefix_cache_query_tokens = 0
        self._holds: list[tuple[float, int]] = []  # (until, block id), a heap

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def max_sequence_blocks(self) -> int:
        """The most blocks one sequence can hold: the whole pool."""
        return len(self.blocks)

    def free_blocks_for(self, seq: Sequence) -> int:
        """Free blocks `seq` could take (all of them: one pool)."""
        return len(self.free_block_ids)

    def shares_pool(self, seq: Sequence, other: Sequence) -> bool:
        """Whether freeing the blocks of `other` gives blocks `seq` can take (always: one pool)."""
        return True

    def cached_block_hashes(self, limit: int | None = None) -> list[bytes]:
        """The hashes the prefix cache can serve now (for node heartbeats); at most `limit`:
        those of blocks in use first, then free ones, most recently freed first. Those are the
        last the cache would evict, and a sequence frees its head blocks last, so a prefix's
        head stays in before its tail."""
        if limit is None or len(self.cached_blocks) <= limit:
            return list(self.cached_blocks)
        chosen = [h for h, b in self.cached_blocks.items() if self.blocks[b].ref_count > 0]
        for block_id in reversed(self.free_block_ids):
            if len(chosen) >= limit:
                break
            block_hash = self.blocks[block_id].block_hash
            if block_hash is not None and self.cached_blocks.get(block_hash) == block_id:
                chosen.append(block_hash)
        return chosen[:limit]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`, never covering its last token."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for index, block_hash in enumerate(
            seq.full_block_hashes(seq.num_tokens - 1, self.block_size)
        ):
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            start = index * self.block_size
            # The hash is strong, but comparing tokens makes a collision harmless.
            if self.blocks[block_id].token_ids != tuple(
                seq.token_ids[start : start + self.block_size]
            ):
                break
            hits.append(block_id)
        return hits

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, hits: list[int] = ()) -> int:
        """Free blocks that scheduling `num_new_tokens` more tokens of `seq` would consume."""
        held = len(seq.block_table) or len(hits)
        computed = seq.num_computed_tokens or len(hits) * self.block_size
        new_blocks = max(0, seq.num_blocks_for(computed + num_new_tokens, self.block_size) - held)
        revived = sum(1 for block_id in hits if self.blocks[block_id].ref_count == 0)
        return new_blocks + revived

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Give a waiting sequence its prefix-cache hits as its first blocks."""
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        seq.num_committed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_cache_hit_tokens += seq.num_computed_tokens
            self.prefix_cache_query_tokens += seq.num_prompt_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, contiguous: bool = False) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False if blocks run out.
        `contiguous` takes consecutive block ids where it can (`_contiguous_free`), for blocks
        that will be sent to or received from another node: a run of consecutive blocks moves as
        one piece per layer, a scattered one as one small piece per block and layer."""
        target = seq.num_blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        missing = target - len(seq.block_table)
        if missing > len(self.free_block_ids):
            return False
        if contiguous and missing > 1:
            seq.block_table.extend(self._take_free_block(b) for b in self._contiguous_free(missing))
            return True
        for _ in range(missing):
            seq.block_table.append(self._take_free_block())
        return True

    def _contiguous_free(self, count: int) -> list[int]:
        """`count` free block ids in as few runs of consecutive ids as the free list allows: the
        run of at least `count` whose first block was freed longest ago, else the longest runs.
        (It evicts out of LRU order; only blocks that move between nodes are taken so.)"""
        rank = {block_id: index for index, block_id in enumerate(self.free_block_ids)}
        ordered = sorted(rank)
        runs: list[list[int]] = []
        start = 0
        for index in range(1, len(ordered) + 1):
            if index == len(ordered) or ordered[index] != ordered[index - 1] + 1:
                runs.append(ordered[start:index])
                start = index
        long_enough = [run for run in runs if len(run) >= count]
        if long_enough:
            return min(long_enough, key=lambda run: rank[run[0]])[:count]
        chosen: list[int] = []
        for run in sorted(runs, key=len, reverse=True):
            chosen.extend(run[: count - len(chosen)])
            if len(chosen) == count:
                break
        return chosen

    def commit_computed_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that became full of computed tokens in the last step."""
        if not self.enable_prefix_caching:
            return
        hashes = seq.full_block_hashes(seq.num_computed_tokens, self.block_size)
        for index in range(seq.num_committed_blocks, len(hashes)):
            block_hash = hashes[index]
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is not None or block_hash in self.cached_blocks:
                continue
            start = index * self.block_size
            block.block_hash = block_hash
            block.token_ids = tuple(seq.token_ids[start : start + self.block_size])
            self.cached_blocks[block_hash] = block.block_id
        seq.num_committed_blocks = len(hashes)

    def free(self, seq: Sequence) -> None:
        """Release the blocks of `seq`, tail first, keeping their prefix-cache registration."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []

    @property
    def num_held_blocks(self) -> int:
        return len(self._holds)

    def hold(self, block_ids: list[int], until: float) -> None:
        """Keep `block_ids` allocated until `until` (time.time()), one reference each."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            heapq.heappush(self._holds, (until, block_id))

    def release_holds(self, now: float) -> int:
        """Drop the holds that ended by `now`; returns how many blocks were let go."""
        released = 0
        while self._holds and self._holds[0][0] <= now:
            _, block_id = heapq.heappop(self._holds)
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
            released += 1
        return released

    def _take_free_block(self, block_id: int | None = None) -> int:
        """The least recently freed block, or `block_id` (which must be free)."""
        if block_id is None:
            block_id, _ = self.free_block_ids.popitem(last=False)
        else:
            del self.free_block_ids[block_id]
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # Evict: the least recently freed cached block is overwritten.
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
            block.token_ids = None
        block.ref_count = 1
        return block_id

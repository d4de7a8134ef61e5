"""Continuous batching under a per-step token budget.

Each step: sequences that are decoding get their one token first; sequences in the middle of a
(chunked) prefill continue next; then waiting sequences are admitted in arrival order while budget,
sequence slots and KV blocks last. A long prompt is cut into chunks so it never holds decoding
back for more than one step. When a running sequence needs a block and none is free, the most
recently admitted sequence is preempted: its blocks are freed and it is recomputed later.

A waiting sequence whose next uncached block another sequence computes in this very step waits a
step (others behind it are admitted meanwhile): requests that arrive together with a shared
prefix (a batch's lines, an agent's parallel calls) then reuse that prefix from the cache instead
of each prefilling it side by side.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from inference.engine.block_manager import BlockManager
from inference.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    """What to run this step, decodes (one new token) first, and what finished without running."""

    scheduled: list[ScheduledSequence]
    finished: list[Sequence]
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides, step by step, which sequences run and how many tokens each computes."""

    def __init__(
        self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished and release its blocks (abort, deadline, stop, length)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.time()

    def schedule(self) -> SchedulerOutput:
        now = time.time()
        expired = [
            s
            for s in (*self.running, *self.waiting)
            if s.deadline is not None and s.deadline <= now
        ]
        for seq in expired:
            self.finish(seq, "deadline")

        budget = self.max_num_batched_tokens
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []
        preempted = 0
        # Decoding sequences first, then those in the middle of a chunked prefill.
        ordered = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        scheduled_ids: set[str] = set()
        for seq in ordered:
            if seq.status != SequenceStatus.RUNNING or budget == 0:
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = next(
                    (s for s in reversed(self.running) if s.request_id not in scheduled_ids),
                    None,
                )
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            scheduled_ids.add(seq.request_id)
            (decodes if num_new == 1 else prefills).append(ScheduledSequence(seq, num_new))
            budget -= num_new

        computing = self._blocks_computed_this_step(prefills)
        deferred: list[Sequence] = []
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            hits = self.block_manager.match_prefix(seq)
            if self._waits_for_a_shared_block(seq, len(hits), computing):
                deferred.append(self.waiting.popleft())
                continue
            computed = len(hits) * self.block_manager.block_size
            num_new = min(seq.num_tokens - computed, budget)
            needed = self.block_manager.blocks_needed(seq, num_new, hits)
            if needed > self.block_manager.num_free_blocks:
                break
            self.waiting.popleft()
            self.block_manager.admit(seq, hits)
            allocated = self.block_manager.allocate_slots(seq, num_new)
            assert allocated, "blocks_needed promised enough free blocks"
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            scheduled = ScheduledSequence(seq, num_new)
            (decodes if num_new == 1 else prefills).append(scheduled)
            computing |= self._blocks_computed_this_step([scheduled])
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))  # first in line again next step

        return SchedulerOutput(decodes + prefills, expired, preempted)

    def _blocks_computed_this_step(self, scheduled: list[ScheduledSequence]) -> set[bytes]:
        """Hashes of the full blocks the scheduled prefills complete in this step."""
        if not self.block_manager.enable_prefix_caching:
            return set()
        size = self.block_manager.block_size
        hashes: set[bytes] = set()
        for item in scheduled:
            seq = item.seq
            done = seq.full_block_hashes(seq.num_computed_tokens + item.num_new_tokens, size)
            hashes.update(done[seq.num_computed_tokens // size :])
        return hashes

    def _waits_for_a_shared_block(self, seq: Sequence, num_hits: int, computing: set[bytes]):
        """Whether the first block `seq` would compute is being computed by another sequence now
        (it will be in the cache after this step)."""
        if not computing:
            return False
        upcoming = seq.full_block_hashes(seq.num_tokens - 1, self.block_manager.block_size)
        return num_hits < len(upcoming) and upcoming[num_hits] in computing

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

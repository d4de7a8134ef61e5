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

A sequence whose prompt a prefill node computes (`remote_prefill`, inference/disagg) is admitted
only when the blocks for its whole prompt and its `max_tokens` reserve are free; it takes them at
once and waits, out of the running batch, for its KV (AWAITING_KV) until `kv_deadline`. Then it
is admitted again under a new epoch (a retry, or a local prefill after `kv_remote_attempts`), and
the blocks a late write could still reach stay held (BlockManager.hold) until the write deadline
and `kv_hold_grace_s` have passed.
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
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        kv_wait_s: float = 30.0,
        kv_hold_grace_s: float = 5.0,
        kv_remote_attempts: int = 2,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.kv_wait_s = kv_wait_s
        self.kv_hold_grace_s = kv_hold_grace_s
        self.kv_remote_attempts = kv_remote_attempts
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.awaiting_kv: dict[str, Sequence] = {}
        self.kv_requests: list[Sequence] = []  # admitted to await KV since the engine last asked
        self.num_preemptions = 0
        self.num_kv_timeouts = 0
        self.num_kv_fallbacks = 0  # remote prefills given up for a local one

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.awaiting_kv)

    def has_runnable(self) -> bool:
        """Whether a step could compute something (sequences awaiting KV cannot)."""
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished and release its blocks (abort, deadline, stop, length)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.AWAITING_KV:
            self._drop_kv_wait(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.time()

    def schedule(self) -> SchedulerOutput:
        now = time.time()
        self.block_manager.release_holds(now)
        expired = [
            s
            for s in (*self.running, *self.awaiting_kv.values(), *self.waiting)
            if s.deadline is not None and s.deadline <= now
        ]
        for seq in expired:
            self.finish(seq, "deadline")
        for seq in [s for s in self.awaiting_kv.values() if s.kv_deadline <= now]:
            self.kv_timed_out(seq)

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
                    (
                        s
                        for s in reversed(self.running)
                        if s.request_id not in scheduled_ids
                        and self.block_manager.shares_pool(seq, s)
                    ),
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
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) + len(self.awaiting_kv) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            hits = self.block_manager.match_prefix(seq)
            if seq.remote_prefill and len(hits) * self.block_manager.block_size >= (
                seq.num_prompt_tokens - 1
            ):
                seq.remote_prefill = False  # the cache holds every block a prefill would send
            if seq.remote_prefill:
                if not self._admit_awaiting_kv(seq, hits, now):
                    break
                continue
            if self._waits_for_a_shared_block(seq, len(hits), computing):
                deferred.append(self.waiting.popleft())
                continue
            computed = len(hits) * self.block_manager.block_size
            num_new = min(seq.num_tokens - computed, budget)
            # A prefill-only prompt's blocks are sent to a decode node: all taken at once, in
            # consecutive runs (BlockManager.allocate_slots), however many chunks compute them.
            allocate = seq.num_tokens - computed if seq.prefill_only else num_new
            needed = self.block_manager.blocks_needed(seq, allocate, hits)
            if needed > self.block_manager.free_blocks_for(seq):
                break
            self.waiting.popleft()
            self.block_manager.admit(seq, hits)
            allocated = self.block_manager.allocate_slots(seq, allocate, seq.prefill_only)
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

    def _num_transferable_blocks(self, seq: Sequence) -> int:
        """The blocks holding every prompt token but the last (which the decode node computes
        itself, to sample from it); the last of them may be partly filled."""
        return seq.num_blocks_for(seq.num_prompt_tokens - 1, self.block_manager.block_size)

    def _admit_awaiting_kv(self, seq: Sequence, hits: list[int], now: float) -> bool:
        """Take the blocks of the whole prompt for `seq` and let it await its KV; False (it
        stays first in line) while they, with its `max_tokens` reserve, are not free."""
        manager = self.block_manager
        computed = len(hits) * manager.block_size
        needed = manager.blocks_needed(seq, seq.num_tokens - computed, hits)
        total = seq.num_tokens + (seq.params.max_tokens or 0)
        reserve = seq.num_blocks_for(total, manager.block_size) - seq.num_blocks_for(
            seq.num_tokens, manager.block_size
        )
        if needed + reserve > manager.free_blocks_for(seq):
            return False
        self.waiting.popleft()
        manager.admit(seq, hits)
        allocated = manager.allocate_slots(seq, seq.num_tokens - computed, contiguous=True)
        assert allocated, "blocks_needed promised enough free blocks"
        seq.status = SequenceStatus.AWAITING_KV
        seq.kv_epoch += 1
        seq.kv_first_block = len(hits)
        seq.kv_deadline = now + self.kv_wait_s
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        self.awaiting_kv[seq.request_id] = seq
        self.kv_requests.append(seq)
        return True

    def kv_arrived(self, seq: Sequence) -> None:
        """The prompt's transferable blocks of `seq` were written: it runs from there (the
        engine registers them in the prefix cache). The written blocks stay held until the write
        deadline has passed: a duplicate of the write may still come."""
        del self.awaiting_kv[seq.request_id]
        manager = self.block_manager
        written = seq.block_table[seq.kv_first_block : self._num_transferable_blocks(seq)]
        manager.hold(written, seq.kv_deadline + self.kv_hold_grace_s)
        seq.num_computed_tokens = seq.num_prompt_tokens - 1
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def kv_timed_out(self, seq: Sequence) -> None:
        """No KV by the deadline: admit `seq` again, remotely under a new epoch while attempts
        are left, else to prefill here."""
        self.num_kv_timeouts += 1
        self.retry_kv(seq, remote=seq.kv_epoch < self.kv_remote_attempts)

    def retry_kv(self, seq: Sequence, remote: bool) -> None:
        """Admit `seq` again, first in line: awaiting a new epoch's KV, or (`remote` False) to
        prefill here."""
        self._drop_kv_wait(seq)
        seq.reset_for_recompute()
        seq.num_preemptions -= 1  # not a preemption
        if not remote:
            seq.remote_prefill = False
            self.num_kv_fallbacks += 1
        self.waiting.appendleft(seq)

    def _drop_kv_wait(self, seq: Sequence) -> None:
        """Stop awaiting KV: the blocks a prefill node may still write stay held until its write
        deadline (and the grace) has passed; the rest are freed."""
        del self.awaiting_kv[seq.request_id]
        writable = seq.block_table[seq.kv_first_block : self._num_transferable_blocks(seq)]
        self.block_manager.hold(writable, seq.kv_deadline + self.kv_hold_grace_s)
        self.block_manager.free(seq)

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

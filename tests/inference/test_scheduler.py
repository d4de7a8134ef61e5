"""Scheduling policy: token budget, decodes first, chunked prefill, preemption, deadlines."""

from __future__ import annotations

import time

from inference.engine import SamplingParams
from inference.engine.block_manager import BlockManager
from inference.engine.scheduler import Scheduler
from inference.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, budget=32, max_seqs=8, block_size=4):
    return Scheduler(BlockManager(num_blocks, block_size), budget, max_seqs)


def seq(request_id: str, n: int, deadline: float | None = None) -> Sequence:
    return Sequence(
        request_id, list(range(1, n + 1)), SamplingParams(max_tokens=8), deadline=deadline
    )


def complete_step(plan, sampled_token: int = 7) -> None:
    """What the engine does after running a step: advance, and append a sampled token."""
    for item in plan.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.token_ids.append(sampled_token)


def test_long_prompt_is_chunked_under_the_token_budget():
    scheduler = make(budget=10)
    scheduler.add(seq("long", 25))
    sizes = []
    for _ in range(3):
        plan = scheduler.schedule()
        sizes.append([i.num_new_tokens for i in plan.scheduled])
        assert plan.num_batched_tokens <= 10
        complete_step(plan)
    assert sizes == [[10], [10], [5]]


def test_decodes_are_scheduled_before_prefill_chunks():
    scheduler = make(budget=8)
    scheduler.add(seq("a", 3))
    complete_step(scheduler.schedule())  # a finished its prompt and is now decoding
    scheduler.add(seq("b", 30))
    plan = scheduler.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in plan.scheduled] == [("a", 1), ("b", 7)]
    complete_step(plan)
    plan = scheduler.schedule()
    # b is mid-prefill and admitted before no one else, yet a's decode still comes first.
    assert plan.scheduled[0].seq.request_id == "a" and plan.scheduled[0].num_new_tokens == 1


def test_max_num_seqs_bounds_the_running_set():
    scheduler = make(max_seqs=2)
    for i in range(4):
        scheduler.add(seq(f"s{i}", 2))
    plan = scheduler.schedule()
    assert len(plan.scheduled) == 2 and len(scheduler.waiting) == 2


def test_newest_sequence_is_preempted_when_blocks_run_out():
    scheduler = make(num_blocks=4, budget=64, block_size=4)
    old, new = seq("old", 7), seq("new", 7)  # two blocks each: the cache is full
    scheduler.add(old)
    scheduler.add(new)
    complete_step(scheduler.schedule())
    for _ in range(2):  # both now hold 8 tokens (2 full blocks), and need a third block
        complete_step(scheduler.schedule())
    assert new.status == SequenceStatus.WAITING
    assert new.num_computed_tokens == 0 and new.block_table == []
    assert scheduler.num_preemptions >= 1
    assert old.status == SequenceStatus.RUNNING
    assert scheduler.waiting[0] is new  # first in line to come back


def test_expired_sequences_finish_with_reason_deadline():
    scheduler = make()
    late = seq("late", 3, deadline=time.time() - 1)
    ok = seq("ok", 3, deadline=time.time() + 60)
    scheduler.add(late)
    scheduler.add(ok)
    plan = scheduler.schedule()
    assert plan.finished == [late] and late.finish_reason == "deadline"
    assert [i.seq for i in plan.scheduled] == [ok]

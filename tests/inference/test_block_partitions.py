"""One block pool per rank under data-parallel attention (inference/engine/block_partitions.py):
where a sequence is placed, that its blocks and preemptions stay in its rank's pool, and that the
pools add up to one node's figures."""

from __future__ import annotations

from inference.engine import SamplingParams
from inference.engine.block_partitions import PartitionedBlockManager
from inference.engine.scheduler import Scheduler
from inference.engine.sequence import Sequence
from tests.inference.test_scheduler import complete_step

BLOCK = 4


def seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=8))


def run(scheduler: Scheduler, steps: int = 1) -> list[str]:
    scheduled = []
    for _ in range(steps):
        plan = scheduler.schedule()
        scheduled += [item.seq.request_id for item in plan.scheduled]
        complete_step(plan)
        for item in plan.scheduled:  # as the engine does after each step
            scheduler.block_manager.commit_computed_blocks(item.seq)
    return scheduled


def test_new_sequences_alternate_between_the_ranks():
    manager = PartitionedBlockManager(2, 8, BLOCK)
    scheduler = Scheduler(manager, 64, 8)
    sequences = [seq(f"s{i}", list(range(1 + 10 * i, 9 + 10 * i))) for i in range(4)]
    for item in sequences:
        scheduler.add(item)
    run(scheduler)
    assert [s.partition for s in sequences] == [0, 1, 0, 1]
    # Each rank's pool holds its own two sequences' prompts, two blocks each.
    assert [pool.num_free_blocks for pool in manager.pools] == [4, 4]
    assert manager.num_free_blocks == 8 and manager.num_blocks == 16
    assert manager.max_sequence_blocks == 8


def test_a_prefix_is_served_from_the_rank_that_caches_it():
    manager = PartitionedBlockManager(2, 8, BLOCK)
    scheduler = Scheduler(manager, 64, 8)
    shared = list(range(100, 108))  # two full blocks
    first, filler = seq("first", shared + [1]), seq("filler", list(range(200, 209)))
    scheduler.add(filler)
    scheduler.add(first)
    run(scheduler)
    assert (filler.partition, first.partition) == (0, 1)
    for done in (first, filler):
        scheduler.finish(done, "stop")
    # Both pools are wholly free again (their blocks still cached): the hit decides.
    second = seq("second", shared + [2, 3])
    scheduler.add(second)
    run(scheduler)
    assert second.partition == 1 and second.num_cached_tokens == 8
    assert manager.prefix_cache_hit_tokens == 8
    assert manager.prefix_cache_query_tokens == 9 + 9 + 10
    assert set(manager.cached_block_hashes()) >= set(second.full_block_hashes(8, BLOCK))


def test_preemption_frees_blocks_in_the_pool_that_needs_them():
    """Rank 0's pool runs out: a sequence of rank 0 is preempted, never rank 1's."""
    manager = PartitionedBlockManager(2, 3, BLOCK)
    scheduler = Scheduler(manager, 64, 8)
    a, b, c = (
        seq(name, list(range(start, start + 4))) for name, start in (("a", 1), ("b", 11), ("c", 21))
    )
    for item in (a, b, c):
        scheduler.add(item)
    run(scheduler)
    assert [s.partition for s in (a, b, c)] == [0, 1, 0]
    # Each grows a block per four tokens: rank 0's three blocks hold a and c's first two.
    run(scheduler, steps=4)
    assert scheduler.num_preemptions >= 1
    assert b.num_preemptions == 0
    assert c.num_preemptions + a.num_preemptions == scheduler.num_preemptions

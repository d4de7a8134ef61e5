"""Block hashing and the block manager's prefix cache: hits, ref counts, LRU eviction."""

from __future__ import annotations

from inference.engine import SamplingParams, compute_block_hashes
from inference.engine.block_manager import BlockManager
from inference.engine.sequence import Sequence

BS = 4


def seq(tokens: list[int], namespace: str = "org", request_id: str = "r") -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=4), namespace)


def run_prefill(manager: BlockManager, s: Sequence) -> list[int]:
    """Admit `s` with its cache hits, allocate the rest and mark the prompt computed."""
    hits = manager.match_prefix(s)
    manager.admit(s, hits)
    assert manager.allocate_slots(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    manager.commit_computed_blocks(s)
    return hits


def test_block_hashes_chain_and_depend_on_namespace():
    tokens = list(range(10))
    hashes = compute_block_hashes(tokens, BS, "org-a")
    assert len(hashes) == 2  # the trailing 2 tokens make no full block
    assert hashes == compute_block_hashes(tokens, BS, "org-a")
    assert hashes != compute_block_hashes(tokens, BS, "org-b")
    other = compute_block_hashes([99] + tokens[1:], BS, "org-a")
    # A change in block 0 changes every later hash: the chain covers the whole prefix.
    assert other[0] != hashes[0] and other[1] != hashes[1]


def test_engine_sequence_hashes_equal_the_public_helper():
    tokens = list(range(3, 30))
    s = seq(tokens, "org-x")
    assert s.full_block_hashes(len(tokens), BS) == compute_block_hashes(tokens, BS, "org-x")


def test_second_request_hits_shared_full_blocks_only():
    manager = BlockManager(num_blocks=16, block_size=BS)
    first = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    run_prefill(manager, first)
    second = seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44], request_id="s")
    hits = run_prefill(manager, second)
    assert hits == first.block_table[:2]
    assert second.num_cached_tokens == 8
    assert manager.blocks[hits[0]].ref_count == 2


def test_last_prompt_token_is_never_served_from_cache():
    manager = BlockManager(num_blocks=16, block_size=BS)
    tokens = list(range(1, 9))  # exactly two full blocks
    run_prefill(manager, seq(tokens))
    again = seq(tokens, request_id="again")
    assert len(manager.match_prefix(again)) == 1


def test_namespaces_do_not_share_blocks():
    manager = BlockManager(num_blocks=16, block_size=BS)
    run_prefill(manager, seq(list(range(1, 12)), "org-a"))
    assert manager.match_prefix(seq(list(range(1, 12)), "org-b", "b")) == []


def test_freed_blocks_stay_cached_until_evicted_least_recent_first():
    manager = BlockManager(num_blocks=4, block_size=BS)
    a = seq([1, 1, 1, 1, 2, 2, 2, 2, 9], request_id="a")
    run_prefill(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 4
    # Both full blocks are still served after the request ended.
    probe = seq([1, 1, 1, 1, 2, 2, 2, 2, 7], request_id="probe")
    assert len(manager.match_prefix(probe)) == 2
    # Allocation takes the least recently freed block: first the never-used block 3, then a's
    # unhashed tail, then its second block (a freed tail first), keeping the shared head longest.
    hits_after_each = []
    for index, token in enumerate([5, 6, 7, 8]):
        run_prefill(manager, seq([token] * 3, request_id=f"filler{index}"))
        hits_after_each.append(len(manager.match_prefix(probe)))
    assert hits_after_each == [2, 2, 1, 0]


def test_hash_hit_with_different_tokens_is_rejected():
    manager = BlockManager(num_blocks=8, block_size=BS)
    a = seq([1, 2, 3, 4, 5])
    run_prefill(manager, a)
    # Simulate a hash collision: the indexed block's tokens do not match the request's.
    manager.blocks[a.block_table[0]].token_ids = (9, 9, 9, 9)
    assert manager.match_prefix(seq([1, 2, 3, 4, 6], request_id="x")) == []


def test_allocation_fails_cleanly_when_blocks_run_out():
    manager = BlockManager(num_blocks=2, block_size=BS)
    s = seq(list(range(1, 13)))
    manager.admit(s, [])
    assert not manager.allocate_slots(s, 12)
    assert s.block_table == [] and manager.num_free_blocks == 2


def test_a_bounded_digest_names_blocks_in_use_then_the_most_recently_freed_heads_first():
    """The heartbeat's digest is bounded (heartbeat.DIGEST_MAX_BLOCKS): past the bound it keeps
    what the cache would evict last."""
    manager = BlockManager(num_blocks=32, block_size=BS)
    old, recent, running = (
        seq(list(range(start, start + 9)), request_id=f"r{start}") for start in (100, 200, 300)
    )
    for s in (old, recent):  # each registers 2 full blocks, then ends
        run_prefill(manager, s)
    old_hashes, recent_hashes = list(old.block_table[:2]), list(recent.block_table[:2])
    manager.free(old)
    manager.free(recent)
    run_prefill(manager, running)  # still running: its blocks are in use
    hashes = {block_id: manager.blocks[block_id].block_hash for block_id in range(32)}
    in_use = [hashes[b] for b in running.block_table[:2]]
    assert sorted(manager.cached_block_hashes()) == sorted(
        [*in_use, *(hashes[b] for b in old_hashes + recent_hashes)]
    )
    assert manager.cached_block_hashes(limit=6) == manager.cached_block_hashes()
    # Blocks in use, then the recent request's head before its tail; the old one is left out.
    assert manager.cached_block_hashes(limit=4) == [
        *in_use,
        hashes[recent_hashes[0]],
        hashes[recent_hashes[1]],
    ]
    assert manager.cached_block_hashes(limit=3) == [*in_use, hashes[recent_hashes[0]]]
    assert manager.cached_block_hashes(limit=1) == in_use[:1]

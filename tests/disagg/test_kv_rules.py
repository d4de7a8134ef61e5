"""The decode side's rules, on one engine: what it allocates before asking for KV, what an epoch
makes stale, and which blocks it holds so that no late write lands in another request's blocks.
Plus the transfer's run coalescing and addressing, checked against the tensors themselves."""

from __future__ import annotations

import time

import pytest
import torch

from inference.disagg.layout import (
    KVLayout,
    KVPeers,
    KVRegion,
    LayoutMismatchError,
    RankBuffer,
    kv_layout_of,
)
from inference.disagg.transfer import KVTransfer, contiguous_runs
from inference.engine import EngineConfig, LLMEngine, SamplingParams
from inference.engine.sequence import SequenceStatus

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(
        model=str(model_dir),
        dtype="float32",
        max_model_len=512,
        num_kv_blocks=40,
        kv_wait_s=60.0,
        kv_hold_grace_s=0.0,
    )
    return LLMEngine(EngineConfig(**{**settings, **overrides}))


def run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
    return tokens


def test_a_remote_request_takes_its_whole_prompt_at_once_and_waits_for_blocks_and_reserve(
    tiny_llama_dir,
):
    decode = engine(tiny_llama_dir, num_kv_blocks=20)
    prompt = list(range(3, 3 + 100))  # 7 blocks of 16, the 7th partial
    decode.add_request("a", prompt, GREEDY, remote_prefill=True)
    decode.step()
    [kv] = decode.take_kv_requests()
    assert decode.scheduler.awaiting_kv["a"].status == SequenceStatus.AWAITING_KV
    assert decode.block_manager.num_free_blocks == 20 - 7
    # It asks for every prompt token but the last (computed here to sample from it).
    assert kv.first_block == 0 and len(kv.block_ids) == 7 and kv.token_ids == prompt[:99]
    assert kv.epoch == 1 and kv.deadline > time.time()
    # 13 blocks free: a second such prompt (7 blocks) with max_tokens=200 (13 more) must wait.
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    decode.add_request("b", list(range(200, 300)), params, remote_prefill=True)
    decode.step()
    assert decode.take_kv_requests() == [] and decode.num_waiting == 1
    assert decode.block_manager.num_free_blocks == 13


def test_a_prefix_the_decode_node_holds_is_not_asked_for(tiny_llama_dir):
    decode = engine(tiny_llama_dir)
    prompt = list(range(3, 3 + 100))
    decode.add_request("warm", prompt[:70], GREEDY)
    run_to_end(decode)
    decode.add_request("a", prompt, GREEDY, remote_prefill=True)
    decode.step()
    [kv] = decode.take_kv_requests()
    assert kv.first_block == 4 and kv.cached_tokens == 64 and len(kv.block_ids) == 3
    # Holding every token but the last, it computes that one itself.
    decode.add_request("b", prompt[:65], GREEDY, remote_prefill=True, namespace="")
    decode.step()
    assert decode.take_kv_requests() == [] and decode.num_awaiting_kv == 1  # only "a"


def test_a_stale_epoch_changes_nothing_and_a_timeout_asks_again_into_other_blocks(
    tiny_llama_dir,
):
    decode = engine(tiny_llama_dir, kv_wait_s=0.05, kv_remote_attempts=2, kv_hold_grace_s=0.3)
    decode.add_request("a", list(range(3, 103)), GREEDY, remote_prefill=True)
    decode.step()
    [first] = decode.take_kv_requests()
    time.sleep(0.06)
    decode.step()  # past kv_wait_s: admitted again under epoch 2
    [second] = decode.take_kv_requests()
    assert second.epoch == 2 and not set(second.block_ids) & set(first.block_ids)
    # The first attempt's blocks stay held (a late write may still come), not free.
    assert decode.block_manager.num_held_blocks == len(first.block_ids)
    assert not decode.kv_arrived("a", first.epoch)  # stale
    assert decode.scheduler.awaiting_kv["a"].kv_epoch == 2
    time.sleep(0.06)
    # The second timeout: no attempts left, it prefills here (in this very step).
    tokens = [t for output in decode.step() for t in output.token_ids]
    assert decode.take_kv_requests() == [] and decode.stats().num_kv_fallbacks == 1
    tokens += run_to_end(decode)["a"]
    reference = engine(tiny_llama_dir)
    reference.add_request("a", list(range(3, 103)), GREEDY)
    assert tokens == run_to_end(reference)["a"]
    time.sleep(0.4)
    decode.release_holds()
    assert decode.block_manager.num_held_blocks == 0
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_held_blocks_are_never_handed_to_another_request_until_the_hold_ends(tiny_llama_dir):
    decode = engine(tiny_llama_dir, num_kv_blocks=12, kv_wait_s=0.2, kv_hold_grace_s=0.2)
    decode.add_request("a", list(range(3, 103)), GREEDY, remote_prefill=True)
    decode.step()
    [kv] = decode.take_kv_requests()
    assert decode.abort("a")  # the client went away while its KV was on the way
    decode.step()
    held = set(kv.block_ids)
    assert decode.block_manager.num_held_blocks == 7 and decode.block_manager.num_free_blocks == 5
    # Another request that needs more than the free blocks waits rather than take held ones.
    decode.add_request("b", list(range(200, 300)), GREEDY)
    decode.step()
    seq = decode.sequences["b"]
    assert not held & set(seq.block_table)
    tokens = run_to_end(decode)
    assert len(tokens["b"]) == 4
    assert decode.block_manager.num_free_blocks == 12  # the hold ended meanwhile


def test_kv_arrival_registers_the_written_blocks_in_the_prefix_cache_and_counts_both_hits(
    tiny_llama_dir,
):
    decode = engine(tiny_llama_dir)
    decode.add_request("a", list(range(3, 103)), GREEDY, remote_prefill=True)
    decode.step()
    [kv] = decode.take_kv_requests()
    assert decode.kv_arrived("a", kv.epoch, prefill_cached_tokens=48)
    assert not decode.kv_arrived("a", kv.epoch)  # a repeated prefill_done
    run_to_end(decode)
    # The transferred blocks now serve a later prompt with the same prefix.
    decode.add_request("b", list(range(3, 103)) + [9], GREEDY)
    decode.step()
    assert decode.sequences["b"].num_cached_tokens == 96


def test_a_refused_prefill_runs_here_at_once(tiny_llama_dir):
    decode = engine(tiny_llama_dir)
    decode.add_request("a", list(range(3, 60)), GREEDY, remote_prefill=True)
    decode.step()
    [kv] = decode.take_kv_requests()
    assert not decode.kv_failed("a", kv.epoch + 1)
    assert decode.kv_failed("a", kv.epoch)
    assert len(run_to_end(decode)["a"]) == 4


def test_a_prefill_only_request_samples_nothing_and_keeps_its_blocks_until_released(
    tiny_llama_dir,
):
    prefill = engine(tiny_llama_dir, max_num_batched_tokens=32)  # chunked: 3 steps
    prefill.add_request("p", list(range(3, 83)), SamplingParams(max_tokens=1), prefill_only=True)
    outputs = []
    while prefill.has_unfinished_requests():
        outputs += prefill.step()
    [done] = outputs
    assert done.finish_reason == "prefilled" and done.token_ids == [] and done.finished
    assert len(prefill.prefilled_blocks("p")) == 5
    assert prefill.block_manager.num_free_blocks == 35
    prefill.release_prefilled("p")
    assert prefill.block_manager.num_free_blocks == 40
    assert len(prefill.cached_block_hashes()) == 5  # kept in its prefix cache


def test_runs_coalesce_only_where_both_sides_are_consecutive():
    assert contiguous_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 7]) == [(4, 0, 3), (9, 3, 1), (10, 7, 1)]
    assert contiguous_runs([], []) == []


def test_a_write_lands_in_exactly_the_peer_blocks_named_every_layer_keys_and_values(
    tiny_llama_dir,
):
    source, target = engine(tiny_llama_dir), engine(tiny_llama_dir, num_kv_blocks=24)
    source.runner.kv_buffer.copy_(torch.randn_like(source.runner.kv_buffer))
    before = target.runner.kv_buffer.clone()
    ours = KVTransfer(source.runner.kv_buffer, kv_layout_of(source, "tiny"))
    theirs = KVTransfer(target.runner.kv_buffer, kv_layout_of(target, "tiny"))
    src, dst = [7, 8, 9, 20], [3, 4, 5, 11]
    stats = ours.write_blocks(theirs.region, src, dst)
    assert stats.blocks == 4 and stats.pieces == 2 * 2 * source.model_config.num_layers
    expected = before.clone()
    expected[:, :, dst] = source.runner.kv_buffer[:, :, src]
    assert torch.equal(target.runner.kv_buffer, expected)


def test_a_fragmented_write_of_thousands_of_pieces_goes_through_and_the_next_one_too(
    tiny_llama_dir,
):
    """Every other block: one run per block, 6 pieces each (3 layers, keys and values): 2,400
    pieces, more than Mooncake's TCP transport takes in one batch."""
    source = engine(tiny_llama_dir, num_kv_blocks=900)
    target = engine(tiny_llama_dir, num_kv_blocks=900)
    source.runner.kv_buffer.copy_(torch.randn_like(source.runner.kv_buffer))
    ours = KVTransfer(source.runner.kv_buffer, kv_layout_of(source, "tiny"))
    theirs = KVTransfer(target.runner.kv_buffer, kv_layout_of(target, "tiny"))
    src, dst = list(range(0, 800, 2)), list(range(1, 801, 2))
    assert ours.write_blocks(theirs.region, src, dst).pieces == 2400
    assert torch.equal(target.runner.kv_buffer[:, :, dst], source.runner.kv_buffer[:, :, src])
    ours.write_blocks(theirs.region, [5, 6, 7], [0, 2, 4])
    assert torch.equal(target.runner.kv_buffer[:, :, [0, 2, 4]], source.runner.kv_buffer[:, :, 5:8])


def test_layouts_that_differ_are_refused_naming_every_difference():
    ours = KVLayout("tiny", "bfloat16", 16, 4, 2, 32)
    peers = KVPeers(ours)
    same = KVRegion((RankBuffer("127.0.0.1:1", 1),), 10, KVLayout("tiny", "bf16", 16, 4, 2, 32))
    peers.check(same)
    other = KVRegion((RankBuffer("127.0.0.1:2", 1),), 10, KVLayout("tiny", "float32", 8, 4, 2, 32))
    with pytest.raises(LayoutMismatchError) as raised:
        peers.check(other)
    message = str(raised.value)
    assert "dtype 'bfloat16' here, 'float32' there" in message
    assert "block_size 16 here, 8 there" in message and "127.0.0.1:2" in message
    assert peers.num_peers == 2


def test_blocks_that_move_between_nodes_are_taken_in_consecutive_runs(tiny_llama_dir):
    """After churn the free list is out of order (LRU: 20-23, then 5-12); a remote prefill's
    blocks (decode side) and a prefill-only prompt's (prefill side) still come as one run."""
    for flags in ({"remote_prefill": True}, {"prefill_only": True}):
        node = engine(tiny_llama_dir, num_kv_blocks=24, max_num_batched_tokens=200)
        for index in range(20):  # one block each: blocks 0-19
            node.add_request(f"s{index}", [100 + index] * 10, GREEDY)
        node.step()
        for index in range(5, 13):
            node.abort(f"s{index}")
        node.step()
        assert list(node.block_manager.free_block_ids)[:6] == [20, 21, 22, 23, 5, 6]
        node.add_request("x", list(range(3, 103)), GREEDY, **flags)
        node.step()
        seq = node.sequences.get("x") or node.prefilled["x"]  # a prefilled one is done
        assert seq.block_table == list(range(5, 12))

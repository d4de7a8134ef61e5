"""Disaggregation between groups of ranks (docs/disaggregation.md, docs/parallelism.md): each rank
registers its own cache and writes its own heads into the peer ranks that hold them. A Llama
prefill group of two filling a decode group of two (whole blocks rank to rank), a group of two
filling one rank and one rank filling a group of two (each token's heads placed in the other
side's rows), and DeepSeek-V3's latent cache (whole on every rank) between a group of two and one
rank, both ways, all decode to the greedy tokens of one unified rank in float32; layouts of
another head count are refused, naming both layouts and the field.

The tiny models are seeded (an fp32 all-reduce sums in another order than one rank, which could
flip a near-tie greedy choice on some random weights). One torch.distributed group per process:
the Llama prefill group runs in a process of its own (`PrefillProcess`), and each class closes
its group before the next starts.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from inference.disagg.layout import (
    KVPeers,
    LayoutMismatchError,
    RankBuffer,
    head_routes,
    kv_layout_of,
    layouts_pair,
)
from inference.disagg.transfer import GroupTransfer, TransferError
from inference.engine import EngineConfig, LLMEngine, SamplingParams
from tests.disagg.split_engines import PrefillProcess, generate_split, generate_split_by
from tests.inference.tiny_models import build_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# 8-token blocks, prompts over 16 tokens prefilled in chunks.
ENGINE = dict(dtype="float32", block_size=8, num_kv_blocks=48, max_num_batched_tokens=16)
MODEL = "tiny"


def config(directory, tensor_parallel: int = 1) -> EngineConfig:
    return EngineConfig(model=str(directory), tensor_parallel=tensor_parallel, **ENGINE)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def unified(engine: LLMEngine, prompt: list[int], request_id: str) -> list[int]:
    """`engine`'s own greedy tokens (in a namespace no split request shares)."""
    engine.add_request(request_id, prompt, GREEDY, namespace="unified")
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.extend(output.token_ids)
    return tokens


@pytest.fixture(scope="class")
def llama(tmp_path_factory):
    """(one unified rank and its transfer, a decode group of two and its transfer, a prefill
    group of two in its own process)."""
    directory = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=0)
    one = LLMEngine(config(directory))
    decode = LLMEngine(config(directory, tensor_parallel=2))
    prefill = None
    try:
        transfers = [GroupTransfer(e, kv_layout_of(e, MODEL)) for e in (one, decode)]
        prefill = PrefillProcess(config(directory, tensor_parallel=2), MODEL)
        yield (one, transfers[0]), (decode, transfers[1]), prefill
    finally:
        if prefill is not None:
            prefill.close()
        decode.close()


class TestLlamaGroups:
    def test_a_prefill_group_fills_a_decode_group_of_its_size_rank_by_rank(self, llama):
        (one, _), (decode, transfer), prefill = llama
        assert [len(transfer.region.ranks), len(prefill.region.ranks)] == [2, 2]
        layout = transfer.region.layout
        assert (layout.tensor_parallel, layout.num_kv_heads) == (2, 1)  # 2 KV heads, 1 a rank
        assert all(r.whole for r in head_routes(prefill.region.layout, layout, 0))
        for index, prompt in enumerate(prompts(1, [37, 9])):
            expected = unified(one, prompt, f"one-{index}")
            split = generate_split_by(
                decode, transfer.region, prefill, f"split-{index}", prompt, GREEDY
            )
            assert split == expected, index

    def test_a_group_of_two_fills_one_rank_head_by_head(self, llama):
        """Rank 0 writes KV head 0 and rank 1 head 1 into each token's row of the one rank."""
        (one, one_transfer), _, prefill = llama
        layout = one_transfer.region.layout
        assert layout.mismatch(prefill.region.layout) is None
        assert layouts_pair(prefill.region.layout.as_dict(), layout.as_dict())
        routes = [head_routes(prefill.region.layout, layout, rank) for rank in (0, 1)]
        assert [[(r.target, r.src_head, r.dst_head, r.heads) for r in rs] for rs in routes] == [
            [(0, 0, 0, 1)],
            [(0, 0, 1, 1)],
        ]
        for index, prompt in enumerate(prompts(4, [29, 8])):  # the last block part-filled
            expected = unified(one, prompt, f"one-many-{index}")
            split = generate_split_by(
                one, one_transfer.region, prefill, f"many-{index}", prompt, GREEDY
            )
            assert split == expected, index

    def test_one_rank_fills_a_group_of_two_head_by_head(self, llama):
        (one, one_transfer), (decode, transfer), _ = llama
        transfers = (one_transfer, transfer)
        for index, prompt in enumerate(prompts(5, [33, 7])):
            expected = unified(one, prompt, f"one-few-{index}")
            split = generate_split(decode, one, transfers, f"few-{index}", prompt, GREEDY)
            assert split == expected, index

    def test_a_rank_whose_write_fails_is_named_and_the_group_serves_on(self, llama):
        """Rank 1's peer is unreachable: the write raises TransferError naming rank 1 (the
        decode node then prefills itself), and the group still serves. The writes go from the
        group's cache into itself, block 0 onto block 0, so nothing it holds changes."""
        (one, _), (decode, transfer), _ = llama
        unreachable = RankBuffer("127.0.0.1:1", transfer.region.ranks[1].base)
        peer = replace(transfer.region, ranks=(transfer.region.ranks[0], unreachable))
        with pytest.raises(TransferError, match=r"rank 1: .*127\.0\.0\.1:1") as failed:
            transfer.write_blocks(peer, [0], [0])
        assert "rank 0" not in str(failed.value)
        [prompt] = prompts(6, [21])
        expected = unified(one, prompt, "one-after-failure")
        engine_tokens = unified(decode, prompt, "group-after-failure")
        assert engine_tokens == expected

    def test_another_head_count_is_refused_naming_both_layouts(self, llama):
        (_, one_transfer), (_, transfer), _ = llama
        theirs = replace(transfer.region.layout, total_kv_heads=4, num_kv_heads=2)
        other = replace(transfer.region, layout=theirs)
        with pytest.raises(LayoutMismatchError) as refused:
            KVPeers(one_transfer.region.layout).check(other)
        message = str(refused.value)
        assert "KV heads 2 here, 4 there" in message
        assert f"here {one_transfer.region.layout.describe()}; there {theirs.describe()}" in message
        assert "2 rank(s) × 2 kind(s) × 2 KV head(s)" in message
        assert not layouts_pair(one_transfer.region.layout.as_dict(), theirs.as_dict())


@pytest.fixture(scope="class")
def deepseek(tmp_path_factory):
    """(one rank and its transfer, a group of two and its transfer), DeepSeek-V3."""
    directory = build_tiny_model(tmp_path_factory.mktemp("deepseek"), "deepseek-v3", seed=0)
    one = LLMEngine(config(directory))
    group = LLMEngine(config(directory, tensor_parallel=2))
    try:
        transfers = [GroupTransfer(e, kv_layout_of(e, MODEL)) for e in (one, group)]
        yield (one, transfers[0]), (group, transfers[1])
    finally:
        group.close()


class TestLatentAcrossSizes:
    @pytest.mark.parametrize("direction", ["one rank to a group", "a group to one rank"])
    def test_the_latent_cache_moves_between_groups_of_different_sizes(self, deepseek, direction):
        (one, one_transfer), (group, group_transfer) = deepseek
        assert one_transfer.region.layout.mismatch(group_transfer.region.layout) is None
        assert layouts_pair(
            one_transfer.region.layout.as_dict(), group_transfer.region.layout.as_dict()
        )
        if direction == "one rank to a group":
            prefill, decode, transfers = one, group, (one_transfer, group_transfer)
        else:
            prefill, decode, transfers = group, one, (group_transfer, one_transfer)
        seed = 2 if direction == "one rank to a group" else 3
        for index, prompt in enumerate(prompts(seed, [41, 6])):
            expected = unified(one, prompt, f"one-{direction}-{index}")
            request_id = f"split-{direction}-{index}"
            split = generate_split(decode, prefill, transfers, request_id, prompt, GREEDY)
            assert split == expected, index

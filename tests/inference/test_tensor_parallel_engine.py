"""A group of two ranks (real processes on gloo) serves a model as one engine: its greedy output
is token-identical to one rank's in float32, for every family, alone, batched, under chunked
prefill, under preemption and on a prefix-cache hit; with expert parallelism too; close in bf16.
A follower that dies or stalls fails the step with a clear error and leaves no process behind;
followers do not outlive rank 0.

The tiny models are seeded (`build_tiny_model(..., seed=0)`): an fp32 all-reduce sums in
another order than one device, which could flip a near-tie greedy choice on some random
weights; with fixed weights the outcome is reproducible. Group start-up costs seconds, so each
family's group serves every case of its class.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from inference.distributed.group import GroupFailure
from inference.engine import LLM, SamplingParams
from inference.engine.config import EngineConfig
from tests.inference.tiny_models import build_tiny_model

REPOSITORY = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# 12 blocks of 8 tokens (96 tokens of KV) and 16 tokens a step: prompts over 16 tokens are
# prefilled in chunks, and four requests of 20 + 12 tokens (4 blocks each) cannot all run.
ENGINE = dict(dtype="float32", block_size=8, num_kv_blocks=12, max_num_batched_tokens=16)
# Under data-parallel attention each rank's cache holds its own sequences: 7 blocks a rank, so
# that the 40-token prompt (7 blocks with its output) still fits and two of the four requests of
# 4 blocks on one rank still preempt.
DATA_PARALLEL_ENGINE = dict(ENGINE, num_kv_blocks=7)
# (family, expert_parallel, data-parallel attention)
FAMILIES = [
    pytest.param(("llama", 1, False), id="llama"),
    pytest.param(("qwen3", 1, False), id="qwen3"),
    pytest.param(("mixtral", 1, False), id="mixtral"),
    pytest.param(("qwen2-moe", 1, False), id="qwen2-moe"),
    pytest.param(("deepseek-v3", 1, False), id="deepseek-v3"),
    pytest.param(("deepseek-v3", 2, False), id="deepseek-v3-expert-parallel"),
    pytest.param(("deepseek-v3", 2, True), id="deepseek-v3-data-parallel-attention"),
    pytest.param(("qwen2-moe", 2, True), id="qwen2-moe-data-parallel-attention"),
    pytest.param(("llama", 1, True), id="llama-data-parallel"),
]


def random_prompts(seed: int, lengths: list[int], vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def token_ids(llm: LLM, prompts: list[list[int]], namespace: str) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(prompts, GREEDY, namespace=namespace)]


@pytest.fixture(scope="class", params=FAMILIES)
def engines(request, tmp_path_factory):
    """(one rank, a group of two) serving one tiny seeded model, built once per family; closed
    at the end of the class, so that no group outlives it (one group per process)."""
    family, expert_parallel, data_parallel = request.param
    directory = build_tiny_model(tmp_path_factory.mktemp(family), family, seed=0)
    one = LLM(str(directory), **ENGINE)
    two = LLM(
        str(directory),
        tensor_parallel=2,
        expert_parallel=expert_parallel,
        data_parallel_attention=data_parallel,
        **(DATA_PARALLEL_ENGINE if data_parallel else ENGINE),
    )
    yield one, two
    two.engine.close()


class TestTwoRanksMatchOne:
    """Each case runs the same requests on one rank and on a group of two; each uses its own
    prefix-cache namespace, so no case hits what another cached."""

    def test_one_request_alone(self, engines):
        one, two = engines
        [prompt] = random_prompts(1, [5])
        assert token_ids(two, [prompt], "alone") == token_ids(one, [prompt], "alone")

    def test_a_batch(self, engines):
        one, two = engines
        prompts = random_prompts(2, [1, 3, 7, 12])
        assert token_ids(two, prompts, "batch") == token_ids(one, prompts, "batch")

    def test_chunked_prefill(self, engines):
        one, two = engines
        prompts = random_prompts(3, [40, 6])  # 40 tokens: three steps of at most 16
        assert token_ids(two, prompts, "chunked") == token_ids(one, prompts, "chunked")

    def test_preemption(self, engines):
        one, two = engines
        prompts = random_prompts(4, [20, 20, 20, 20])
        before = [llm.engine.scheduler.num_preemptions for llm in (one, two)]
        assert token_ids(two, prompts, "preempt") == token_ids(one, prompts, "preempt")
        after = [llm.engine.scheduler.num_preemptions for llm in (one, two)]
        assert after[0] > before[0] and after[1] > before[1]

    def test_a_prefix_cache_hit(self, engines):
        one, two = engines
        [shared] = random_prompts(5, [24])  # three full blocks
        rounds = [[shared + [7, 8, 9]], [shared + [10, 11]]]
        results = {}
        for name, llm in (("one", one), ("two", two)):
            outputs = [llm.generate(r, GREEDY, namespace="prefix")[0] for r in rounds]
            results[name] = [(o.cached_tokens, o.token_ids) for o in outputs]
        assert [cached for cached, _ in results["two"]] == [0, 24]
        assert results["two"] == results["one"]

    def test_each_rank_caches_its_share_of_the_kv_heads(self, engines):
        """Attention heads split across the ranks, so does the KV cache (each GQA KV head is
        on one rank here: 2 KV heads, 2 ranks); MLA's latent, shared by every head, does not;
        under data-parallel attention a rank caches every head of its own sequences."""
        one, two = engines
        whole, share = one.engine.runner.kv_buffer.shape, two.engine.runner.kv_buffer.shape
        if two.engine.config.data_parallel_attention:
            assert share[:2] + share[3:] == whole[:2] + whole[3:]  # [layer, kind, block, ...]
        elif one.engine.model_config.mla is not None:
            assert share == whole
        else:
            heads = 4  # [layer, kind, block, token, head, dim]
            assert share[heads] == whole[heads] // 2
            assert share[:heads] == whole[:heads] and share[heads + 1 :] == whole[heads + 1 :]

    def test_where_a_batch_runs(self, engines):
        """Data-parallel attention: a batch runs on both ranks' caches, and rank 0's router saw
        only its own sequences' tokens (the rest were routed on rank 1 and sent over).
        Tensor-parallel attention: one block pool, and rank 0 routed every token."""
        one, two = engines
        data_parallel = two.engine.config.data_parallel_attention
        pools = two.engine.block_manager.pools if data_parallel else []
        before = [pool.prefix_cache_query_tokens for pool in pools]
        routed = [llm.engine.stats().expert_tokens for llm in (one, two)]
        prompts = random_prompts(7, [9, 10, 11, 12, 13, 14])
        assert token_ids(two, prompts, "spread") == token_ids(one, prompts, "spread")
        if data_parallel:
            queried = [
                pool.prefix_cache_query_tokens - b for pool, b in zip(pools, before, strict=True)
            ]
            assert all(queried) and sum(queried) == sum(len(p) for p in prompts)
        else:
            assert not hasattr(two.engine.block_manager, "pools")
        if routed[0] is not None:
            one_routed, rank_0_routed = (
                sum(llm.engine.stats().expert_tokens) - sum(start)
                for llm, start in zip((one, two), routed, strict=True)
            )
            if data_parallel:
                assert 0 < rank_0_routed < one_routed
            else:
                assert rank_0_routed == one_routed


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({}, id="tensor-parallel"),
        pytest.param(
            {"expert_parallel": 2, "data_parallel_attention": True}, id="data-parallel-attention"
        ),
    ],
)
def test_bf16_two_ranks_stay_close_to_one(tmp_path, layout):
    """In bf16 the all-reduce rounds partial sums another way than one device's matmul (and
    under data-parallel attention the experts' outputs come back in another order), so the
    check is on each prompt's next-token distribution: at least 22 of 24 top-1 choices agree,
    a disagreement is a near tie (within 0.1 nats on one rank), and every top-5 log-probability
    that both report is within 0.1 of the other's."""
    directory = build_tiny_model(tmp_path / "qwen2-moe", "qwen2-moe", seed=0)
    options = dict(dtype="bfloat16", block_size=8, num_kv_blocks=64)
    params = SamplingParams(
        temperature=0.0, max_tokens=1, logprobs=True, top_logprobs=5, ignore_eos=True
    )
    prompts = random_prompts(6, [random.Random(n).randrange(1, 40) for n in range(24)])
    one = [r.logprobs[0] for r in LLM(str(directory), **options).generate(prompts, params)]
    llm = LLM(str(directory), tensor_parallel=2, **layout, **options)
    try:
        two = [r.logprobs[0] for r in llm.generate(prompts, params)]
    finally:
        llm.engine.close()
    agreed = 0
    for a, b in zip(one, two, strict=True):
        agreed += a.token_id == b.token_id
        top_a, top_b = dict(a.top_logprobs), dict(b.top_logprobs)
        if a.token_id != b.token_id:
            assert top_a.get(b.token_id, -1e9) >= a.logprob - 0.1
        for token in top_a.keys() & top_b.keys():
            assert abs(top_a[token] - top_b[token]) <= 0.1
    assert agreed >= 22


@pytest.fixture
def tiny_llama(tmp_path):
    return build_tiny_model(tmp_path / "llama", "llama", seed=0)


def gone(pid: int) -> bool:
    """Whether process `pid` has ended: absent, or a zombie that no parent reaped yet (an
    orphan's new parent, in a container, may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def start_generating(tiny_llama, **options) -> LLM:
    llm = LLM(str(tiny_llama), tensor_parallel=2, **ENGINE, **options)
    for index, prompt in enumerate(random_prompts(7, [6, 9])):
        llm.engine.add_request(f"r{index}", prompt, GREEDY)
    llm.engine.step()
    llm.engine.step()
    return llm


def test_a_follower_killed_mid_step_fails_the_step_and_leaves_no_process(tiny_llama):
    # A long timeout: the step must fail because the dead rank's connection closed, not wait
    # the timeout out.
    llm = start_generating(tiny_llama, distributed_timeout_s=120)
    [follower] = llm.engine.group.pids
    # Stopped, the follower takes no step: rank 0's next step blocks on it, and the kill lands
    # while it waits.
    os.kill(follower, signal.SIGSTOP)
    threading.Timer(0.5, os.kill, (follower, signal.SIGKILL)).start()
    with pytest.raises(GroupFailure, match="rank 1 exited with code -9") as failure:
        llm.engine.step()
    assert "Timed out" not in str(failure.value)
    with pytest.raises(GroupFailure, match="is down"):  # the engine stays down
        llm.engine.step()
    llm.engine.close()
    assert gone(follower)


def test_a_stalled_follower_fails_the_step_after_the_timeout(tiny_llama):
    llm = start_generating(tiny_llama, distributed_timeout_s=2)
    [follower] = llm.engine.group.pids
    os.kill(follower, signal.SIGSTOP)
    try:
        with pytest.raises(GroupFailure, match="mid-step"):
            llm.engine.step()
    finally:
        llm.engine.close()
    assert gone(follower)


def test_followers_exit_when_rank_0_is_killed(tiny_llama):
    script = textwrap.dedent(
        f"""
        import time
        from inference.engine import LLM

        if __name__ == "__main__":
            llm = LLM({str(tiny_llama)!r}, tensor_parallel=2, dtype="float32")
            print(*llm.engine.group.pids, flush=True)
            time.sleep(600)
        """
    )
    rank_0 = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPOSITORY
    )
    try:
        [follower] = map(int, rank_0.stdout.readline().split())
    finally:
        rank_0.kill()
        rank_0.wait()
    deadline = time.monotonic() + 60
    while not gone(follower) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(follower)


def test_the_group_settings_are_checked():
    with pytest.raises(ValueError, match="expert_parallel must be 1 or tensor_parallel"):
        EngineConfig(tensor_parallel=2, expert_parallel=4)
    with pytest.raises(ValueError, match="tensor_parallel must be at least 1"):
        EngineConfig(tensor_parallel=0)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        EngineConfig(tensor_parallel=2, distributed_backend="nccl")
    assert EngineConfig(tensor_parallel=2).backend == "gloo"
    with pytest.raises(ValueError, match="data_parallel_attention needs a group"):
        EngineConfig(data_parallel_attention=True)


def test_data_parallel_attention_needs_the_experts_spread(tmp_path):
    directory = build_tiny_model(tmp_path / "mixtral", "mixtral", seed=0)
    with pytest.raises(ValueError, match="set expert_parallel to the group's size"):
        LLM(str(directory), tensor_parallel=2, data_parallel_attention=True, dtype="float32")


def test_expert_parallelism_needs_experts(tiny_llama):
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(str(tiny_llama), tensor_parallel=2, expert_parallel=2, dtype="float32")

"""Property test: any workload (random prompt lengths with shared prefixes, budgets, cache
sizes, aborts) leaves the engine consistent, and greedy float32 output never depends on what else
was running, on chunking, on preemption or on the prefix cache."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from inference.engine import LLM, SamplingParams

MAX_NEW = 8


@pytest.fixture(scope="module")
def reference_llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)


workloads = st.fixed_dictionaries(
    {
        "prompts": st.lists(
            st.tuples(st.integers(0, 2), st.lists(st.integers(3, 300), min_size=1, max_size=40)),
            min_size=1,
            max_size=8,
        ),
        "budget": st.integers(4, 96),
        # Blocks beyond what the longest request needs alone: few means heavy preemption.
        "spare_blocks": st.integers(0, 12),
        "block_size": st.sampled_from([8, 16]),
        "abort_after": st.lists(st.integers(0, 6), max_size=3),
    }
)
SHARED_PREFIXES = [[], list(range(10, 30)), list(range(40, 75))]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(workload=workloads)
def test_any_workload_finishes_consistently(tiny_llama_dir, reference_llm, workload):
    prompts = [SHARED_PREFIXES[p] + tail for p, tail in workload["prompts"]]
    block_size = workload["block_size"]
    longest = max(-(-(len(p) + MAX_NEW) // block_size) for p in prompts)
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_num_batched_tokens=workload["budget"],
        num_kv_blocks=max(2, longest + workload["spare_blocks"]),  # the engine's minimum
        block_size=block_size,
        max_model_len=256,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    to_abort = {str(i % len(prompts)): step for i, step in enumerate(workload["abort_after"])}
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finals = {}
    step = 0
    while engine.has_unfinished_requests():
        for request_id, at in to_abort.items():
            if at == step:
                engine.abort(request_id)
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out
        step += 1
        assert step < 2000, "the engine stopped making progress"

    event(f"preempted={engine.scheduler.num_preemptions > 0}")
    event(f"cache_hit={any(o.cached_tokens for o in finals.values())}")
    assert set(finals) == set(tokens)
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks  # every block came back
    assert all(b.ref_count == 0 for b in manager.blocks)
    for request_id, out in finals.items():
        prompt = prompts[int(request_id)]
        assert out.prompt_tokens == len(prompt)
        assert 0 <= out.cached_tokens <= len(prompt) - 1
        assert out.cached_tokens % block_size == 0
        assert out.completion_tokens == len(tokens[request_id])
        if out.finish_reason == "abort":
            continue
        assert out.finish_reason == "length" and out.completion_tokens == MAX_NEW
        [alone] = reference_llm.generate([prompt], params)
        assert tokens[request_id] == alone.token_ids

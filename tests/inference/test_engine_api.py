"""The online and offline APIs: request lifecycle, errors, abort, deadlines, reporting."""

from __future__ import annotations

import time

import numpy as np
import pytest

from inference.engine import (
    LLM,
    EngineConfig,
    InvalidRequestError,
    LLMEngine,
    ModelLoadError,
    SamplingParams,
)
from tests.waiting import wait_for


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256))


def drain(engine: LLMEngine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_step_streams_tokens_and_reports_usage_and_timings(engine):
    engine.add_request(
        "r1", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    outs = drain(engine)["r1"]
    assert [len(o.token_ids) for o in outs] == [1] * 6
    assert [o.finished for o in outs] == [False] * 5 + [True]
    final = outs[-1]
    assert final.finish_reason == "length"
    assert (final.prompt_tokens, final.completion_tokens, final.cached_tokens) == (5, 6, 0)
    t = final.timings
    assert 0 <= t.queued_s <= t.ttft_s <= t.e2e_s and t.tpot_s > 0


def test_abort_finishes_the_request_and_frees_its_blocks(engine):
    free_before = engine.block_manager.num_free_blocks
    engine.add_request("long", list(range(3, 40)), SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort("long")
    outs = engine.step()
    [final] = [o for o in outs if o.request_id == "long"]
    assert final.finished and final.finish_reason == "abort"
    assert final.completion_tokens == 2
    assert engine.block_manager.num_free_blocks == free_before
    assert not engine.abort("long")  # already gone


def test_deadline_expires_a_running_request(engine):
    deadline = time.time() + 0.3
    engine.add_request(
        "late", [3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True), deadline=deadline
    )
    first = engine.step()
    assert [o.request_id for o in first] == ["late"] and not first[0].finished
    wait_for(lambda: time.time() > deadline, "the deadline to pass")
    [final] = engine.step()
    assert final.finished and final.finish_reason == "deadline"
    assert final.completion_tokens == 1
    assert not engine.has_unfinished_requests()


def test_deadline_expires_a_waiting_request(engine):
    engine.add_request("dead", [3, 4, 5], SamplingParams(), deadline=time.time() - 1)
    [final] = drain(engine)["dead"]
    assert final.finish_reason == "deadline" and final.completion_tokens == 0


def test_stop_token_ids_end_generation_with_reason_stop(engine, tiny_llama_dir):
    [free_run] = LLM(str(tiny_llama_dir), dtype="float32").generate(
        [[3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )
    stop_token = free_run.token_ids[3]
    first = free_run.token_ids.index(stop_token)
    engine.add_request(
        "stop",
        [3, 4, 5, 6],
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_token]),
    )
    final = drain(engine)["stop"][-1]
    assert final.finish_reason == "stop"
    assert final.completion_tokens == first + 1


def test_seeded_sampling_is_reproducible(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=42, ignore_eos=True)
    a = llm.generate([[3, 4, 5]], params)[0].token_ids
    b = llm.generate(
        [[3, 4, 5], [7, 8, 9, 10]], [params, SamplingParams(temperature=1.0, max_tokens=5)]
    )[0].token_ids
    assert a == b


def test_logprobs_are_reported_per_token(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    params = SamplingParams(
        temperature=0, max_tokens=5, logprobs=True, top_logprobs=2, ignore_eos=True
    )
    [result] = llm.generate([[3, 4, 5]], params)
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    for lp in result.logprobs:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0][0] == lp.token_id  # greedy picks the most likely
        assert np.isclose(lp.top_logprobs[0][1], lp.logprob)


@pytest.mark.parametrize(
    "prompt,params,param,message",
    [
        ([], SamplingParams(), "prompt", "empty"),
        (list(range(3, 260)), SamplingParams(), "prompt", "context length is 256"),
        ([3] * 200, SamplingParams(max_tokens=100), "max_tokens", "cannot fit"),
        ([3, 10**6], SamplingParams(), "prompt", "outside the vocabulary"),
    ],
)
def test_bad_requests_raise_clear_errors(engine, prompt, params, param, message):
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("bad", prompt, params)
    assert error.value.param == param
    assert message in str(error.value)
    assert "bad" not in engine.sequences


def test_duplicate_request_ids_are_rejected(engine):
    engine.add_request("dup", [3, 4], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [3, 4], SamplingParams(max_tokens=2))
    drain(engine)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        LLMEngine(EngineConfig(model=str(tmp_path / "no-such-model")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        LLMEngine(EngineConfig(model=str(tmp_path / "empty")))


def test_gguf_of_unsupported_architecture_is_refused(tmp_path):
    import gguf

    path = tmp_path / "tiny-bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'bert' is not supported"):
        LLMEngine(EngineConfig(model=str(path)))


def test_unsupported_hf_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).save_pretrained(
        str(tmp_path)
    )
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_invalid_engine_settings_are_rejected():
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float16x")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=7)
    with pytest.raises(ValueError, match="int4"):
        EngineConfig(dtype="float32", quantization="int4")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")


def test_stop_string_ends_the_request_and_is_not_in_the_text(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    [free_run] = llm.generate([[3, 4, 5, 6]], free)
    text = free_run.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the tiny model's text is too short to cut"
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    [stopped] = llm.generate([[3, 4, 5, 6]], params)
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]
    assert stop not in stopped.text


def test_a_request_waiting_for_a_slot_reports_its_queue_time(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first, second = llm.generate([[3, 4, 5], [6, 7, 8]], params)
    assert second.timings.queued_s >= first.timings.e2e_s * 0.5
    assert second.timings.queued_s <= second.timings.ttft_s <= second.timings.e2e_s


def test_stats_and_cached_hashes_let_a_gateway_route_on_prefixes(tiny_llama_dir):
    from inference.engine import compute_block_hashes

    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=32)
    engine = llm.engine
    prompt = list(range(3, 60))  # 57 tokens: three full blocks of 16
    llm.generate([prompt], SamplingParams(max_tokens=2), namespace="org-a")
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_blocks) == (0, 0, 32)
    assert stats.num_free_blocks == 32  # finished: every block is free, and still cached
    assert stats.block_size == 16
    cached = set(engine.cached_block_hashes())
    assert set(compute_block_hashes(prompt, 16, "org-a")) <= cached
    assert not set(compute_block_hashes(prompt, 16, "org-b")) & cached
    llm.generate([prompt], SamplingParams(max_tokens=2), namespace="org-a")
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == 48
    assert stats.prefix_cache_query_tokens == 2 * len(prompt)


def test_requests_arriving_together_with_a_shared_prefix_reuse_it(tiny_llama_dir):
    """The first computes the shared blocks; the others wait one step and take them from the
    cache, instead of prefilling the same prefix side by side. Greedy output is unchanged."""
    shared = list(range(10, 58))  # three full blocks of 16
    prompts = [shared + [100 + i, 200 + i, 300 + i] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    together = LLM(str(tiny_llama_dir), dtype="float32").generate(prompts, params)
    assert [r.cached_tokens for r in together] == [0, 48, 48, 48]
    alone = [
        LLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False).generate(
            [prompt], params
        )[0]
        for prompt in prompts[:2]
    ]
    assert [r.token_ids for r in together[:2]] == [r.token_ids for r in alone]

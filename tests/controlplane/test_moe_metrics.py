"""An MoE node reports the tokens it routed to each expert: its engine counts them per step and
in total, its heartbeat carries the total, and `/metrics` shows one counter per expert."""

from __future__ import annotations

from prometheus_client import parser

from inference.engine import LLM, SamplingParams
from inference.node.state import engine_state
from tests.inference.tiny_models import build_tiny_model


def test_metrics_show_the_tokens_each_expert_received(client, live, tmp_path):
    llm = LLM(str(build_tiny_model(tmp_path / "qwen2-moe", "qwen2-moe")), dtype="float32")
    prompts = [list(range(3, 20)), list(range(30, 41))]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    stats = llm.engine.stats()
    moe = llm.engine.model_config.moe
    sparse = sum(moe.is_sparse(layer) for layer in range(llm.engine.model_config.num_layers))
    computed = sum(len(p) for p in prompts) + 3 * len(prompts)  # the prompts, 3 decode steps
    assert sum(stats.expert_tokens) == computed * moe.top_k * sparse
    # The last step decoded one token of each prompt.
    assert sum(stats.last_step_expert_tokens) == len(prompts) * moe.top_k * sparse

    live("moe-1", engine_state("moe-1", "tiny-moe", "unified", llm.engine, free_slots=4), 60)
    response = client.get("/metrics")
    samples = {
        sample.labels["expert"]: sample.value
        for family in parser.text_string_to_metric_families(response.content.decode())
        for sample in family.samples
        if sample.name == "hearth_node_expert_tokens_total"
        and sample.labels == {**sample.labels, "model": "tiny-moe", "node": "moe-1"}
    }
    assert samples == {str(e): float(n) for e, n in enumerate(stats.expert_tokens)}


def test_a_dense_model_reports_no_experts(tmp_path):
    llm = LLM(str(build_tiny_model(tmp_path / "llama", "llama")), dtype="float32")
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.expert_tokens is None and stats.last_step_expert_tokens is None
    assert "expert_tokens" not in engine_state("d", "m", "unified", llm.engine, free_slots=1)

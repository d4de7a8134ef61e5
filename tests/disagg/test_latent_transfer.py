"""Disaggregation moves MLA's latent blocks as it moves keys and values: the transfer is the
cache's bytes, one kind ([latent | rope key]) instead of two. A tiny DeepSeek-V3's prompts
computed by a prefill engine and written over the Transfer Engine decode to transformers'
greedy tokens; a latent cache and a per-head cache refuse each other."""

from __future__ import annotations

import pytest

from inference.disagg.layout import KVPeers, LayoutMismatchError, kv_layout_of
from inference.disagg.transfer import KVTransfer
from inference.engine import EngineConfig, LLMEngine, SamplingParams
from tests.disagg.split_engines import generate_split
from tests.inference.conftest import hf_greedy
from tests.inference.tiny_models import build_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, **overrides)
    )


def test_latent_blocks_written_by_a_prefill_engine_decode_to_hf_tokens(tmp_path):
    model_dir = build_tiny_model(tmp_path / "deepseek", "deepseek-v3")
    prompts = {"long": list(range(3, 80)), "short": [5, 9, 17, 40, 41, 3, 8]}
    expected = dict(zip(prompts, hf_greedy(model_dir, list(prompts.values()), 12), strict=True))
    decode = make_engine(model_dir)
    prefill = make_engine(model_dir, max_num_batched_tokens=24)  # chunked
    layout = kv_layout_of(decode, "tiny-deepseek")
    assert (layout.kinds, layout.num_kv_heads, layout.head_dim) == (1, 1, 32 + 8)
    ours = KVTransfer(prefill.runner.kv_buffer, kv_layout_of(prefill, "tiny-deepseek"))
    theirs = KVTransfer(decode.runner.kv_buffer, layout)
    for request_id, prompt in prompts.items():
        tokens = generate_split(decode, prefill, (ours, theirs), request_id, prompt, GREEDY)
        assert tokens == expected[request_id], request_id


def test_a_latent_cache_and_a_per_head_cache_refuse_each_other(tmp_path):
    mla = make_engine(build_tiny_model(tmp_path / "deepseek", "deepseek-v3"))
    dense = make_engine(build_tiny_model(tmp_path / "llama", "llama"))
    peer = KVTransfer(dense.runner.kv_buffer, kv_layout_of(dense, "m"))
    with pytest.raises(LayoutMismatchError, match="kinds 1 here, 2 there"):
        KVPeers(kv_layout_of(mla, "m")).check(peer.region)

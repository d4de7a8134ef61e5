"""Grammar-constrained decoding in the engine, on a random-weight model: whatever the model would
say, a constrained request's output parses and validates, and the unconstrained requests that
share its batch are untouched."""

from __future__ import annotations

import json

import jsonschema
import pytest

from inference.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from inference.structured.tool_calls import parse_tool_calls
from tests.inference.json_schemas import ADD_TOOL, SCHEMAS, WEATHER_TOOL

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", max_model_len=1024, max_num_seqs=64
        )
    )


def run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, tuple[str, str]]:
    """(text, finish_reason) of each request, all run in the same batches."""
    for request_id, params in requests.items():
        engine.add_request(request_id, PROMPT, params)
    texts: dict[str, list[str]] = {r: [] for r in requests}
    reasons = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id].append(out.text)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return {r: ("".join(texts[r]), reasons[r]) for r in requests}


def test_every_schema_is_obeyed_greedy_and_sampled(engine):
    """25 schemas × (greedy, three seeds at temperature 1), strict mode, in one batch."""
    requests = {}
    for index, schema in enumerate(SCHEMAS):
        spec = {"type": "json_schema", "schema": schema, "strict": True}
        for seed in (None, 1, 2, 3):
            temperature = 0.0 if seed is None else 1.0
            requests[f"s{index}-{seed}"] = SamplingParams(
                max_tokens=600, temperature=temperature, seed=seed, structured=spec
            )
    results = run(engine, requests)
    for request_id, (text, reason) in results.items():
        schema = SCHEMAS[int(request_id[1:].split("-")[0])]
        assert reason == "stop", (request_id, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_gives_an_object(engine):
    requests = {
        f"o{seed}": SamplingParams(
            max_tokens=200, temperature=1.0, seed=seed, structured={"type": "json_object"}
        )
        for seed in range(6)
    }
    for text, reason in run(engine, requests).values():
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # an open-ended object may run out of tokens; what there is still follows JSON
            assert reason == "length" and text.startswith("{")


def test_unconstrained_requests_in_the_batch_are_untouched(engine):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = run(engine, {"free": free})["free"]
    spec = {"type": "json_schema", "schema": SCHEMAS[0], "strict": True}
    mixed = run(
        engine,
        {
            "c1": SamplingParams(max_tokens=60, temperature=0.0, structured=spec),
            "free": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            "c2": SamplingParams(max_tokens=60, temperature=1.0, seed=4, structured=spec),
        },
    )
    assert mixed["free"] == alone
    assert mixed["c1"][0] != alone[0]


TOOLS = [tool["function"] for tool in (WEATHER_TOOL, ADD_TOOL)]


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_tool_calls_parse_and_validate(engine, parallel):
    spec = {"type": "tool_calls", "tools": TOOLS, "parallel": parallel}
    requests = {
        f"t{seed}": SamplingParams(max_tokens=400, temperature=1.0, seed=seed, structured=spec)
        for seed in range(8)
    }
    parameters = {tool["name"]: tool["parameters"] for tool in TOOLS}
    for text, reason in run(engine, requests).values():
        assert reason == "stop", text
        content, calls = parse_tool_calls(text)
        assert content is None and calls
        if not parallel:
            assert len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), parameters[call.name])


def test_a_named_function_is_the_only_one_called(engine):
    spec = {"type": "tool_calls", "tools": TOOLS[1:], "parallel": False}
    results = run(
        engine, {f"n{s}": SamplingParams(max_tokens=200, seed=s, structured=spec) for s in range(4)}
    )
    for text, _ in results.values():
        _, [call] = parse_tool_calls(text)
        assert call.name == "add"


def test_logit_bias_forces_and_bans_tokens(engine):
    forced = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logit_bias={"42": 100})
    banned_token = engine.tokenizer.encode(
        run(engine, {"x": SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)})["x"][0]
    )
    assert run(engine, {"f": forced})["f"][0] == engine.tokenizer.decode([42] * 5)
    ban = SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, logit_bias={str(banned_token[0]): -100}
    )
    engine.add_request("b", PROMPT, ban)
    [out] = [o for o in engine.step() if o.request_id == "b"]
    assert out.token_ids != banned_token[:1]


@pytest.mark.parametrize(
    ("structured", "param"),
    [
        ({"type": "regex"}, "response_format"),
        (
            {
                "type": "json_schema",
                "schema": {"type": "object", "properties": {"a": {"type": "strang"}}},
            },
            "response_format",
        ),
        ({"type": "tool_calls", "tools": []}, "tools"),
    ],
)
def test_a_spec_the_grammar_engine_refuses_names_its_field(engine, structured, param):
    with pytest.raises(InvalidRequestError) as raised:
        engine.add_request("bad", PROMPT, SamplingParams(structured=structured))
    assert raised.value.param == param
    assert "bad" not in engine.sequences


def test_logit_bias_outside_the_vocabulary_is_refused(engine):
    with pytest.raises(InvalidRequestError) as raised:
        engine.add_request("bad", PROMPT, SamplingParams(logit_bias={"999999": 5}))
    assert raised.value.param == "logit_bias"


def test_the_cpu_mask_matches_xgrammars_own(engine):
    import torch
    import xgrammar as xgr

    grammars = engine.grammars
    vocab = grammars.vocab_size
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(5, vocab)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    grammars.apply(logits, bitmask)
    assert torch.equal(logits, expected)

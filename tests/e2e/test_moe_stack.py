"""A DeepSeek-V3 model (MLA attention, grouped-routing MoE) on the production stack, driven by the
official `openai` package: added with `manage.py addmodel`, served by a node process next to
uvicorn and the worker, on PostgreSQL and Redis. Its weights are tiny and random, so what parses
below was made to by the grammar, and what repeats was made to by greedy decoding."""

from __future__ import annotations

import io
import json
import os

import jsonschema
import openai
import pytest
from django.core.management import call_command

from controlplane.catalog.models import ServedModel
from tests.e2e.user_path import LONG_SYSTEM
from tests.inference.json_schemas import ADD_TOOL, SCHEMAS, WEATHER_TOOL
from tests.inference.tiny_models import build_tiny_model

pytestmark = pytest.mark.django_db(transaction=True)

BLOCK_SIZE = 16  # the engine's default KV block, the prefix cache's unit
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny_deepseek_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-deepseek-v3"), "deepseek-v3")


@pytest.fixture
def deepseek_model(transactional_db, tiny_deepseek_dir) -> ServedModel:
    """The tiny DeepSeek-V3 in the catalog as an operator adds it, under an id of this run's own
    (the node registry in Redis is shared by every run on the machine), with room in its context
    for the tool descriptions."""
    model_id = f"tiny-deepseek-v3-{os.getpid()}"
    call_command(
        "addmodel", model_id, "--source", str(tiny_deepseek_dir), "--context-length", "1024",
        "--input", "0.60", "--cached-input", "0.10", "--output", "3.00",
        stdout=io.StringIO(),
    )  # fmt: skip
    return ServedModel.objects.get(id=model_id)


def test_deepseek_v3_serves_chat_streams_structured_outputs_and_tools(
    stack, deepseek_model, acme_key
):
    model = deepseek_model.id
    stack.start_node(model, "node-a")
    stack.wait_ready(model, nodes=1, api_key=acme_key)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=acme_key, max_retries=0)
    session = {"x-session-affinity": "moe-session-1"}
    try:
        # A conversation whose second turn extends the first: the second reuses the first's
        # prompt from the latent (MLA) prefix cache, every full block of it.
        first_messages = [
            {"role": "system", "content": LONG_SYSTEM},
            {"role": "user", "content": "first file"},
        ]
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=first_messages, max_tokens=8, temperature=0,
            extra_headers=session,
        )  # fmt: skip
        first = raw.parse()
        assert raw.headers["x-hearth-node"] == "node-a"
        assert first.choices[0].finish_reason in ("stop", "length")
        assert 1 <= first.usage.completion_tokens <= 8
        assert first.usage.prompt_tokens > 4 * BLOCK_SIZE
        assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        second_messages = [
            *first_messages,
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "second file"},
        ]
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=second_messages, max_tokens=8, temperature=0,
            extra_headers=session,
        )  # fmt: skip
        second = raw.parse()
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert raw.headers["x-hearth-cached-tokens"] == str(cached)
        assert second.usage.prompt_tokens > first.usage.prompt_tokens
        first_blocks = first.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
        assert first_blocks <= cached < second.usage.prompt_tokens, (cached, first.usage)

        # Streamed, the same greedy request says the same, delta by delta.
        greedy = dict(model=model, messages=ASK, max_tokens=12, temperature=0, seed=7)
        plain = client.chat.completions.create(**greedy)
        stream = client.chat.completions.create(
            **greedy, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == plain.choices[0].message.content
        assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens

        # A strict json_schema response format: the answer parses and validates.
        schema = SCHEMAS[19]  # nested objects: anyOf two shapes, consts, an integer, a string
        answer = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=300, seed=1,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "result", "schema": schema, "strict": True},
            },
        )  # fmt: skip
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)

        # A forced function: one call to it, its arguments valid against its parameters.
        answer = client.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER_TOOL, ADD_TOOL], max_tokens=300, seed=2,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        jsonschema.validate(
            json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"]
        )
    except Exception:
        print(stack.outputs())
        raise

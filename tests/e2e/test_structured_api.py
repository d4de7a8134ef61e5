"""Structured outputs and tool calls through the official `openai` package, against the
production stack (uvicorn, a node process, the worker) with a tiny random-weight model: the model
says nothing sensible on its own, so everything that parses below was made to by the grammar."""

from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest

from controlplane.jobs.models import Job
from tests.controlplane.conftest import priced_model
from tests.e2e.user_path import wait_for
from tests.inference.json_schemas import ADD_TOOL, SCHEMAS, WEATHER_TOOL

pytestmark = pytest.mark.django_db(transaction=True)

WEATHER, ADD = WEATHER_TOOL, ADD_TOOL
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def long_context_model(tiny_llama_dir):
    """The tiny model with room for the tool descriptions in its prompt."""
    return priced_model(f"tiny-tools-{os.getpid()}", str(tiny_llama_dir), 1024)


def check_calls(calls, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def streamed_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    """The calls a stream's `tool_calls` deltas add up to, its finish reason and its content."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            if delta.function:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return calls, reason, content


def test_structured_outputs_and_tool_calls_through_the_sdk(stack, long_context_model, acme_key):
    model = long_context_model.id
    stack.start_node(model, "node-a")
    stack.wait_ready(model, nodes=1, api_key=acme_key)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=acme_key, max_retries=0)
    try:
        # response_format json_schema (strict), plain and streamed, sampled.
        for index, schema in enumerate(SCHEMAS[:6]):
            response_format = {
                "type": "json_schema",
                "json_schema": {"name": f"s{index}", "schema": schema, "strict": True},
            }
            answer = client.chat.completions.create(
                model=model,
                messages=ASK,
                max_tokens=300,
                seed=index,
                response_format=response_format,
            )
            assert answer.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
            stream = client.chat.completions.create(
                model=model,
                messages=ASK,
                max_tokens=300,
                seed=index,
                stream=True,
                response_format=response_format,
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            jsonschema.validate(json.loads(text), schema)

        # json_object.
        answer = client.chat.completions.create(
            model=model,
            messages=ASK,
            max_tokens=200,
            temperature=0,
            response_format={"type": "json_object"},
        )
        if answer.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(answer.choices[0].message.content), dict)

        # tool_choice "required": calls only, valid arguments, finish_reason tool_calls.
        for seed in range(3):
            answer = client.chat.completions.create(
                model=model,
                messages=ASK,
                tools=[WEATHER, ADD],
                tool_choice="required",
                max_tokens=300,
                seed=seed,
            )
            choice = answer.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None
            check_calls(choice.message.tool_calls, {"get_weather", "add"})

        # A named function, streamed: OpenAI's incremental deltas add up to one valid call.
        stream = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=[WEATHER, ADD],
            stream=True,
            max_tokens=300,
            tool_choice={"type": "function", "function": {"name": "add"}},
        )
        calls, reason, content = streamed_calls(stream)
        assert reason == "tool_calls" and content == ""
        [call] = calls.values()
        assert call["name"] == "add" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS["add"])

        # The second turn of a tool conversation: the call and its result go back in.
        [made] = (
            client.chat.completions.create(
                model=model,
                messages=ASK,
                tools=[WEATHER],
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=300,
            )
            .choices[0]
            .message.tool_calls
        )
        follow_up = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [made.model_dump()]},
            {"role": "tool", "tool_call_id": made.id, "content": '{"temperature": 21}'},
        ]
        answer = client.chat.completions.create(
            model=model,
            messages=follow_up,
            tools=[WEATHER],
            max_tokens=8,
            temperature=0,
        )
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert answer.usage.prompt_tokens > 0

        # tool_choice "auto": the model's own call format is read back. A random model never
        # writes one by itself, so a response format makes it write a Llama 3 style call (a
        # whole-output {"name", "parameters"} object); plain and streamed, it becomes tool_calls.
        llama3_call = {
            "type": "json_schema",
            "json_schema": {
                "name": "llama3_call",
                "strict": True,
                "schema": {
                    "type": "object",
                    "properties": {
                        "name": {"const": "add"},
                        "parameters": ADD["function"]["parameters"],
                    },
                    "required": ["name", "parameters"],
                },
            },
        }
        auto = client.chat.completions.create(
            model=model, messages=ASK, tools=[ADD], max_tokens=300, response_format=llama3_call,
        )  # fmt: skip
        assert auto.choices[0].finish_reason == "tool_calls"
        check_calls(auto.choices[0].message.tool_calls, {"add"})
        stream = client.chat.completions.create(
            model=model, messages=ASK, tools=[ADD], max_tokens=300, response_format=llama3_call,
            stream=True,
        )  # fmt: skip
        calls, reason, content = streamed_calls(stream)
        assert reason == "tool_calls" and content == "" and len(calls) == 1
        jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMETERS["add"])

        # A queued job with forced calls carries them in its response, like the sync answer.
        job = client.post(
            "/chat/completions",
            body={
                "model": model,
                "messages": ASK,
                "tools": [ADD],
                "tool_choice": "required",
                "max_tokens": 300,
                "queue": True,
            },
            cast_to=object,
        )
        wait_for(lambda: Job.objects.get(id=job["id"]).status == Job.COMPLETED, what="the tool job")
        done = client.get(f"/jobs/{job['id']}", cast_to=object)
        message = done["response"]["choices"][0]["message"]
        assert done["response"]["choices"][0]["finish_reason"] == "tool_calls"
        for call in message["tool_calls"]:
            assert call["function"]["name"] == "add"
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS["add"])
    except Exception:
        print(stack.outputs())
        raise

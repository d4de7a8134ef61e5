"""Bad structured-output and tool input: a 400 in OpenAI's shape naming the field, and nothing
written; and a model's own tool-call text (tool_choice "auto") read back into `tool_calls`."""

from __future__ import annotations

import pytest

from controlplane.jobs.models import Job
from controlplane.jobs.serializers import job_object
from tests.controlplane.openai_spec import validate
from tests.controlplane.test_completions_api import CHAT, assert_refused, chat
from tests.inference.json_schemas import ADD_TOOL

pytestmark = pytest.mark.django_db(transaction=True)

ADD = ADD_TOOL
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}


def schema_format(schema, name="answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": schema_format({"type": "object"}, name="has space")},
            "response_format.json_schema.name",
        ),
        # Not a valid JSON Schema.
        (
            {
                "response_format": schema_format(
                    {"type": "object", "properties": {"a": {"type": 5}}}
                )
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": schema_format({"type": "string", "minLength": "two"})},
            "response_format.json_schema.schema",
        ),
        # Valid JSON Schema that the grammar engine cannot express.
        (
            {"response_format": schema_format({"type": "string", "pattern": "(?<=a)b"})},
            "response_format.json_schema.schema",
        ),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"tools": [ADD, ADD]}, "tools[1].function.name"),
        (
            {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {"messages": [{"role": "tool", "tool_call_id": "call_9", "content": "4"}]},
            "messages[0].tool_call_id",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_2", "content": "4"},
                ]
            },
            "messages[1].tool_call_id",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "x", "function": {}}]}]},
            "messages[0].tool_calls[0].function",
        ),
        ({"logit_bias": {"abc": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
    ],
)
def test_bad_structured_input_names_its_field(post, tiny, key_a, fields, param):
    body = assert_refused(post(CHAT, chat(**fields), key=key_a), 400, None, param)
    assert body["error"]["type"] == "invalid_request_error"


def test_a_logit_bias_token_outside_the_vocabulary_is_refused(post, tiny, key_a):
    response = post(CHAT, chat(logit_bias={"999999": 1}, queue=True), key=key_a)
    assert_refused(response, 400, "invalid_value", "logit_bias")


def completed_job(org, text: str, request: dict) -> Job:
    return Job.objects.create(
        org=org,
        model="tiny",
        endpoint=Job.CHAT,
        status=Job.COMPLETED,
        request=request,
        prompt_token_ids=[1],
        sampling={},
        result={
            "text": text,
            "token_ids": [],
            "finish_reason": "stop",
            "usage": {"prompt_tokens": 1, "cached_tokens": 0, "completion_tokens": 9},
        },
    )


def test_the_models_own_tool_call_text_becomes_tool_calls_with_auto(org_a):
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    job = completed_job(org_a, text, chat(tools=[ADD]))
    response = job_object(job)["response"]
    validate(response, "CreateChatCompletionResponse")
    [choice] = response["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert call["id"] == f"call_{job.request_id.removeprefix('req_')}_0"


def test_tool_choice_none_leaves_the_text_alone(org_a):
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    job = completed_job(org_a, text, chat(tools=[ADD], tool_choice="none"))
    [choice] = job_object(job)["response"]["choices"]
    assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"

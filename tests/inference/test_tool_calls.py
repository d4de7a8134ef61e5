"""Tool-call text read back into calls: whole outputs, and the same outputs fed as deltas."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from inference.structured.tool_calls import ToolCallStream, parse_tool_calls

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def test_hermes_calls_are_found_in_order_with_the_text_around_them():
    content, calls = parse_tool_calls(f"Let me check.\n{WEATHER}\n{ADD}")
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1, "b": 2}),
    ]


def test_only_calls_leave_no_content():
    assert parse_tool_calls(WEATHER)[0] is None


def test_llama3_json_calls_are_found():
    text = (
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
        '{"name": "f", "parameters": {}}'
    )
    content, calls = parse_tool_calls(text)
    assert content is None
    assert [c.name for c in calls] == ["add", "f"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2}


def test_text_without_calls_comes_back_unchanged():
    for text in ["plain answer", '{"city": "Paris"}', "<tool_call>not json</tool_call>", ""]:
        assert parse_tool_calls(text) == (text, [])


def test_a_block_that_is_not_a_call_stays_in_the_content():
    content, calls = parse_tool_calls(f"<tool_call>oops</tool_call> then {ADD}")
    assert content == "<tool_call>oops</tool_call> then"
    assert [c.name for c in calls] == ["add"]


def streamed(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    stream = ToolCallStream()
    events = []
    position = 0
    for cut in sorted(set(cuts)):
        events += stream.feed(text[position:cut])
        position = cut
    events += stream.feed(text[position:])
    events += stream.finish()
    content = "".join(e.content for e in events if e.call is None)
    return content, [(e.call.name, e.call.arguments) for e in events if e.call]


OUTPUTS = [
    f"Let me check.\n{WEATHER}\n{ADD}",
    WEATHER,
    "no calls here, just <tool_ talk",
    "<tool_call>oops</tool_call> then " + ADD,
    '{"name": "add", "parameters": {"a": 1}}',
    '{"not": "a call"}',
    'unclosed <tool_call>{"name": "add"',
]


@given(st.sampled_from(OUTPUTS), st.lists(st.integers(0, 120), max_size=12))
def test_deltas_give_the_calls_and_content_of_the_whole_text(text, cuts):
    content, calls = streamed(text, [c for c in cuts if c <= len(text)])
    whole_content, whole_calls = parse_tool_calls(text)
    assert calls == [(c.name, c.arguments) for c in whole_calls]
    assert content.strip() == (whole_content or "").strip()


def test_content_before_a_call_streams_before_the_call_ends():
    stream = ToolCallStream()
    events = stream.feed("Checking the weather <tool_")
    assert "".join(e.content for e in events) == "Checking the weather "
    assert stream.feed('call>{"name": "f", "arguments": {}') == []
    [event] = stream.feed("}</tool_call>")
    assert event.call.name == "f"

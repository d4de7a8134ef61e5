"""Tools in the prompt: given to a template that renders them, the documented fallback for one
that does not."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from inference.structured.tool_prompt import FALLBACK_INSTRUCTIONS, prepare_messages
from tests.inference.tiny_models import build_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls', []) %}[call {{ call.function.name }}]{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """A template that knows neither tools nor tool calls (like SmolLM2's)."""
    directory = tmp_path_factory.mktemp("chatml")
    build_tokenizer(directory)
    return AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def tool_aware(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tool-aware")
    tokenizer = build_tokenizer(directory)
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(str(directory))


def render(hf, messages, tools) -> str:
    messages, tools = prepare_messages(hf, messages, tools)
    return hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def test_a_template_without_tools_gets_the_fallback_system_message(chatml):
    text = render(chatml, [{"role": "user", "content": "2+2?"}], TOOLS)
    assert text.startswith("<|im_start|>system\n" + FALLBACK_INSTRUCTIONS)
    assert json.dumps(TOOLS[0]["function"]) in text


def test_the_fallback_joins_an_existing_system_message(chatml):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = render(chatml, messages, TOOLS)
    assert text.count("<|im_start|>system") == 1
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + FALLBACK_INSTRUCTIONS)


def test_assistant_calls_are_written_as_hermes_blocks_where_the_template_drops_them(chatml):
    messages = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
    ]
    text = render(chatml, messages, TOOLS)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in text
    assert "<|im_start|>tool\n1<|im_end|>" in text


def test_a_template_that_renders_tools_gets_them_as_they_are(tool_aware):
    messages = [{"role": "user", "content": "add"}, {"role": "assistant", "tool_calls": [CALL]}]
    text = render(tool_aware, messages, TOOLS)
    assert FALLBACK_INSTRUCTIONS not in text
    assert text.startswith("<|im_start|>tools\n") and "[call add]" in text
    assert "<tool_call>" not in text


def test_without_tools_nothing_changes(chatml):
    messages = [{"role": "user", "content": "hi"}]
    assert render(chatml, messages, None) == chatml.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )

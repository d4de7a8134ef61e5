"""Tools and tool messages in a prompt, for chat templates that know them and for those that do
not.

A template that renders `tools` (Qwen, Llama 3.1, Hermes…) gets them as transformers passes them.
One that ignores them (SmolLM2's ChatML, for one) gets the documented fallback instead: a system
message that lists the functions as JSON and asks for Hermes-format calls, the format the
tool-call parser reads and the forced-call grammar produces. Likewise an assistant message's
`tool_calls` are written into its content as `<tool_call>` blocks when the template drops them.
Whether a template knows each is found by rendering a probe with and without, once per tokenizer.
"""

from __future__ import annotations

import contextlib
import json
from functools import cache
from typing import Any

from inference.structured.tool_calls import HERMES_BEGIN, HERMES_END

FALLBACK_INSTRUCTIONS = (
    "You can call functions. To call one, answer with exactly\n"
    f'{HERMES_BEGIN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n'
    f"{HERMES_END}\n"
    "and nothing else; one block per call. The functions:\n"
)
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_fn", "description": "probe", "parameters": {"type": "object"}},
}
_PROBE_CALL = {
    "id": "call_probe",
    "type": "function",
    "function": {"name": "probe_fn", "arguments": "{}"},
}


def _render(hf, messages, tools=None) -> str:
    return hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


@cache
def _template_support(hf) -> tuple[bool, bool]:
    """(renders tools, renders an assistant's tool_calls) for this tokenizer's template."""
    user = [{"role": "user", "content": "x"}]
    try:
        tools = _render(hf, user, [_PROBE_TOOL]) != _render(hf, user)
    except Exception:  # a template that fails on tools cannot be given them
        tools = False
    plain = [*user, {"role": "assistant", "content": ""}]
    calling = [*user, {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}]
    try:
        calls = _render(hf, calling) != _render(hf, plain)
    except Exception:
        calls = False
    return tools, calls


def _call_block(call: dict[str, Any]) -> str:
    function = call["function"]
    arguments = function.get("arguments") or "{}"
    with contextlib.suppress(ValueError):  # else the model sees the text as it was sent
        arguments = json.loads(arguments)
    body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"{HERMES_BEGIN}\n{body}\n{HERMES_END}"


def fallback_system_text(tools: list[dict[str, Any]]) -> str:
    return FALLBACK_INSTRUCTIONS + "\n".join(
        json.dumps(tool["function"], ensure_ascii=False) for tool in tools
    )


def prepare_messages(
    hf, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand the template: as given where it knows them, rewritten into
    plain messages where it does not."""
    knows_tools, knows_calls = _template_support(hf)
    out = []
    for message in messages:
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""
        if message.get("tool_calls") and not knows_calls:
            blocks = "\n".join(_call_block(call) for call in message.pop("tool_calls"))
            message["content"] = f"{message['content']}\n{blocks}".lstrip("\n")
        out.append(message)
    if not tools or knows_tools:
        return out, tools or None
    system = fallback_system_text(tools)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None

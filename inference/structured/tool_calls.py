"""A model's tool-call text read back into OpenAI's `tool_calls`.

Two formats are recognised:
- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them,
  anywhere in the text (what the forced-call grammar of spec.py produces, too);
- Llama 3: the whole output is a JSON object `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`), or several separated by `;`.

A block that does not parse as a call stays in the content. `ToolCallStream` does the same over
text deltas, holding back only what may still become a call, so content streams as it comes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

HERMES_BEGIN = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(re.escape(HERMES_BEGIN) + r"(.*?)" + re.escape(HERMES_END), re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, call_id: str) -> dict:
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _call_from_json(text: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments already encoded
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _llama3_calls(text: str) -> list[ToolCall] | None:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    calls = [_call_from_json(part) for part in body.split(";") if part.strip()]
    if not calls or any(call is None for call in calls):
        return None
    return calls


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls): the text outside the calls (None when nothing but calls), and the calls
    in order. Without calls the text comes back unchanged."""
    calls: list[ToolCall] = []
    rest: list[str] = []
    position = 0
    for match in _HERMES.finditer(text):
        call = _call_from_json(match.group(1).strip())
        if call is None:
            continue
        rest.append(text[position : match.start()])
        calls.append(call)
        position = match.end()
    if calls:
        rest.append(text[position:])
        content = "".join(rest).strip()
        return content or None, calls
    llama = _llama3_calls(text)
    if llama:
        return None, llama
    return text, []


@dataclass
class StreamEvent:
    """A content delta (`call` None) or one complete call (`content` empty)."""

    content: str = ""
    call: ToolCall | None = None


class ToolCallStream:
    """Feed text deltas; get content deltas and calls as soon as each is known."""

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self._started = False  # any visible text yet (a Llama 3 call must begin the output)
        self._llama = False

    def feed(self, delta: str) -> list[StreamEvent]:
        self._buffer += delta
        if not self._started and self._buffer.strip():
            self._started = True
            head = self._buffer.lstrip()
            self._llama = head.startswith("{") or head.startswith(PYTHON_TAG)
        if self._llama:
            return []  # decided at the end: a whole-output call, or content after all
        events: list[StreamEvent] = []
        while True:
            if self._inside:
                end = self._buffer.find(HERMES_END)
                if end < 0:
                    return events
                block = self._buffer[: end + len(HERMES_END)]
                self._buffer = self._buffer[end + len(HERMES_END) :]
                self._inside = False
                call = _call_from_json(block[len(HERMES_BEGIN) : -len(HERMES_END)].strip())
                events.append(StreamEvent(call=call) if call else StreamEvent(content=block))
                continue
            begin = self._buffer.find(HERMES_BEGIN)
            if begin >= 0:
                if begin:
                    events.append(StreamEvent(content=self._buffer[:begin]))
                self._buffer = self._buffer[begin:]
                self._inside = True
                continue
            keep = _partial_suffix(self._buffer, HERMES_BEGIN)
            cut = len(self._buffer) - keep
            if cut:
                events.append(StreamEvent(content=self._buffer[:cut]))
                self._buffer = self._buffer[cut:]
            return events

    def finish(self) -> list[StreamEvent]:
        """What is left when the output ends."""
        text, self._buffer = self._buffer, ""
        if not text:
            return []
        if self._llama:
            content, calls = parse_tool_calls(text)
            if calls:
                return [StreamEvent(call=call) for call in calls]
            return [StreamEvent(content=content or "")]
        return [StreamEvent(content=text)]  # an unclosed block, or a partial "<tool_call"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0

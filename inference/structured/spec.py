"""What a request constrains its output to, as a plain dict that travels in its SamplingParams.

- `{"type": "json_object"}`: any JSON object.
- `{"type": "json_schema", "schema": {...}, "strict": bool}`: JSON valid against the schema.
  `strict` makes undeclared properties invalid unless the schema allows them (xgrammar's strict
  mode); the output is constrained either way.
- `{"type": "tool_calls", "tools": [{"name", "parameters"}], "parallel": bool}`: one or more (or
  exactly one, without `parallel`) calls in the Hermes format the tool-call parser reads,
  `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, and nothing else: what
  `tool_choice: "required"` or a named function asks for.

`grammar_for` turns a spec into an xgrammar structure; it needs no tokenizer, so the gateway runs
it to refuse a schema the grammar engine cannot express before anything is queued.
"""

from __future__ import annotations

import json
from typing import Any

from inference.errors import InvalidRequestError

KINDS = ("json_object", "json_schema", "tool_calls")
# Tool-call text, as the tool-call parser (tool_calls.py) reads it back.
TOOL_CALL_BEGIN = "<tool_call>\n"
TOOL_CALL_END = "\n</tool_call>"
TOOL_CALL_SEPARATOR = "\n"


def check_spec(spec: Any) -> dict[str, Any]:
    """`spec` if it is well formed; InvalidRequestError (param `response_format`) otherwise."""
    if not isinstance(spec, dict) or spec.get("type") not in KINDS:
        raise InvalidRequestError(
            f"structured must be an object whose type is one of {list(KINDS)}", "response_format"
        )
    if spec["type"] == "json_schema" and not isinstance(spec.get("schema"), dict | bool):
        raise InvalidRequestError("a json_schema spec needs a schema object", "response_format")
    if spec["type"] == "tool_calls":
        tools = spec.get("tools")
        if not isinstance(tools, list) or not tools:
            raise InvalidRequestError("a tool_calls spec needs at least one tool", "tools")
        for tool in tools:
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                raise InvalidRequestError("each tool needs a name", "tools")
    return spec


# Values that are data, not subschemas: never rewritten.
_DATA_KEYWORDS = {"enum", "const", "default", "examples"}


# What a length-bounded string may hold: printable ASCII but the quote and the backslash, then
# U+00A0-U+07FF, U+1000-U+D7FF and U+E000-U+FFFD. xgrammar 0.2.9 accepts raw control characters
# in its own bounded strings, and its byte-level ranges accept invalid UTF-8 (surrogates, and
# overlong 3-byte forms in any range that starts below U+1000), which decodes to U+FFFD and so
# breaks the length: these ranges are the ones it checks exactly. Unbounded strings keep
# xgrammar's own rule, which is right.
BOUNDED_STRING_CHARACTER = r"[ !#-\[\]-~\u00a0-\u07ff\u1000-\ud7ff\ue000-\ufffd]"


def json_safe_strings(schema: Any) -> Any:
    """`schema` with each length-bounded string rewritten as a pattern of the same lengths over
    BOUNDED_STRING_CHARACTER (see there why)."""
    if isinstance(schema, list):
        return [json_safe_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: value if key in _DATA_KEYWORDS else json_safe_strings(value)
        for key, value in schema.items()
    }
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{BOUNDED_STRING_CHARACTER}{{{low},{high}}}$"
    return out


def grammar_for(spec: dict[str, Any]):
    """The xgrammar Grammar that `spec` describes; raises
    InvalidRequestError naming the request field when the grammar engine refuses it."""
    import xgrammar as xgr

    check_spec(spec)
    kind = spec["type"]
    param = "tools" if kind == "tool_calls" else "response_format"
    try:
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(
                json.dumps(json_safe_strings(spec["schema"])),
                any_whitespace=False,
                strict_mode=bool(spec.get("strict", True)),
            )
        return xgr.Grammar.from_structural_tag(_tool_calls_tag(spec))
    except (RuntimeError, ValueError, TypeError) as error:
        raise InvalidRequestError(
            f"the grammar engine cannot express this schema: {_first_line(error)}", param
        ) from None


def _tool_calls_tag(spec: dict[str, Any]):
    from xgrammar.structural_tag import (
        JSONSchemaFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
    )

    tags = [
        TagFormat(
            begin=f'{TOOL_CALL_BEGIN}{{"name": {json.dumps(tool["name"])}, "arguments": ',
            content=JSONSchemaFormat(
                json_schema=json_safe_strings(tool.get("parameters") or {"type": "object"}),
                max_whitespace_cnt=1,
            ),
            end="}" + TOOL_CALL_END,
        )
        for tool in spec["tools"]
    ]
    return StructuralTag(
        format=TagsWithSeparatorFormat(
            tags=tags,
            separator=TOOL_CALL_SEPARATOR,
            at_least_one=True,
            stop_after_first=not spec.get("parallel", True),
        )
    )


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]

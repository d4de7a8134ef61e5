"""Validation of the fields that shape the output: `response_format`, `tools`, `tool_choice`,
`parallel_tool_calls`, and the tool-calling turns of `messages`.

Each check raises ApiError(400) naming the field. A schema is checked twice: as a JSON Schema
(Draft 2020-12 meta-schema) and by the grammar engine itself (inference/structured/spec.py), so
a schema it cannot express is refused here, before anything is queued, not on the node.

The result is the `structured` spec the node constrains decoding with: the response format's
grammar, or, with `tool_choice` "required" or a named function, the grammar of valid calls to
the allowed functions.
"""

from __future__ import annotations

import re
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from controlplane.api.errors import ApiError
from inference.errors import InvalidRequestError
from inference.structured.spec import grammar_for

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _check_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, dict):
        raise _bad(param, f"'{param}' must be a JSON Schema object.", "invalid_type")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path)
        raise _bad(param, f"Invalid JSON schema at '{where or '#'}': {error.message}") from None


def _grammar(spec: dict[str, Any], param: str) -> dict[str, Any]:
    try:
        grammar_for(spec)
    except InvalidRequestError as error:
        raise _bad(param, str(error)) from None
    return spec


def response_format(body: dict) -> dict[str, Any] | None:
    """The `structured` spec of `response_format`, or None for plain text."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("response_format", "'response_format' must be an object.", "invalid_type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise _bad(
            "response_format.type",
            f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad(
            "response_format.json_schema",
            "'response_format.json_schema' must be an object with 'name' and 'schema'.",
            "invalid_type",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(
            "response_format.json_schema.name",
            "'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'.",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("response_format.json_schema.strict", "'strict' must be a boolean.")
    schema = spec.get("schema", {"type": "object"})
    _check_schema(schema, "response_format.json_schema.schema")
    return _grammar(
        {"type": "json_schema", "schema": schema, "strict": bool(strict)},
        "response_format.json_schema.schema",
    )


def tools(body: dict) -> list[dict[str, Any]] | None:
    """The validated `tools`, in OpenAI's shape, or None."""
    value = body.get("tools")
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise _bad("tools", "'tools' must be a non-empty array.", "invalid_type")
    seen = set()
    out = []
    for index, tool in enumerate(value):
        param = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(f"{param}.type", "Each tool must be {'type': 'function', 'function': …}.")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _bad(f"{param}.function", "'function' must be an object.", "invalid_type")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(
                f"{param}.function.name",
                "A function name must be 1-64 letters, digits, '_' or '-'.",
            )
        if name in seen:
            raise _bad(f"{param}.function.name", f"The function name {name!r} appears twice.")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"{param}.function.description", "'description' must be a string.")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        _check_schema(parameters, f"{param}.function.parameters")
        if parameters.get("type", "object") != "object":
            raise _bad(f"{param}.function.parameters", "A function's parameters must be an object.")
        clean = {"name": name, "parameters": parameters}
        if description is not None:
            clean["description"] = description
        out.append({"type": "function", "function": clean})
    return out


def tool_choice(body: dict, declared: list[dict[str, Any]] | None) -> str:
    """'none', 'auto', 'required', or the name of the one function to call."""
    value = body.get("tool_choice")
    if value is None:
        return "auto" if declared else "none"
    if value in ("none", "auto", "required"):
        if value != "none" and not declared:
            raise _bad("tool_choice", f"'tool_choice' {value!r} needs 'tools'.")
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = (value.get("function") or {}).get("name")
        names = [t["function"]["name"] for t in declared or []]
        if name not in names:
            raise _bad(
                "tool_choice.function.name",
                f"'tool_choice' names the function {name!r}, which is not in 'tools'.",
            )
        return name
    raise _bad(
        "tool_choice",
        "'tool_choice' must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': …}}.",
    )


def tool_call_spec(
    declared: list[dict[str, Any]], choice: str, parallel: bool
) -> dict[str, Any] | None:
    """The grammar spec of forced calls ('required' or a named function), else None."""
    if choice in ("none", "auto"):
        return None
    allowed = [
        t["function"] for t in declared if choice == "required" or t["function"]["name"] == choice
    ]
    spec = {
        "type": "tool_calls",
        "tools": [{"name": f["name"], "parameters": f["parameters"]} for f in allowed],
        "parallel": parallel and choice == "required",
    }
    return _grammar(spec, "tools")


def assistant_tool_calls(message: dict, index: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, checked."""
    calls = message.get("tool_calls")
    param = f"messages[{index}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise _bad(param, "'tool_calls' must be a non-empty array.", "invalid_type")
    out = []
    for position, call in enumerate(calls):
        where = f"{param}[{position}]"
        if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not call["id"]:
            raise _bad(f"{where}.id", "Each tool call needs a string 'id'.")
        function = call.get("function")
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise _bad(
                f"{where}.function",
                "Each tool call needs a 'function' with a string 'name' and 'arguments'.",
            )
        out.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        )
    return out


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """Every `tool` message answers a call made by an earlier assistant message."""
    called: set[str] = set()
    for index, message in enumerate(messages):
        for call in message.get("tool_calls") or []:
            called.add(call["id"])
        if message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in called:
                raise _bad(
                    f"messages[{index}].tool_call_id",
                    f"The tool message's tool_call_id {call_id!r} answers no earlier assistant "
                    "tool call.",
                )

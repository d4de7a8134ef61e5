"""25 varied JSON schemas for the structured-output tests: nested objects, arrays, enums, numbers
with bounds, optional fields, anyOf, const, nullable fields, $defs. Strings and arrays carry
bounds so that a random-weight model, which never chooses to stop on its own, still finishes
within the tests' token budget; the grammar has to enforce every one of them."""

from __future__ import annotations

S = {"type": "string", "maxLength": 8}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": S}, "required": ["name"]},
    {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["age"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"unit": {"enum": ["c", "f", "k"]}}, "required": ["unit"]},
    {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}},
        "required": ["x"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}},
        "required": ["tags"],
    },
    {"type": "object", "properties": {"name": S, "nick": S}, "required": ["name"]},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
            }
        },
        "required": ["point"],
    },
    {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, S]}},
        "required": ["v"],
    },
    {
        "type": "object",
        "properties": {
            "kind": {"const": "event"},
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
        },
        "required": ["kind", "id"],
    },
    {
        "type": "object",
        "properties": {"note": {"anyOf": [S, {"type": "null"}]}},
        "required": ["note"],
    },
    {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 10},
                "minItems": 1,
                "maxItems": 4,
            }
        },
        "required": ["scores"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": S,
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {"flag": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
        "required": ["level"],
    },
    {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 100},
            "currency": {"enum": ["USD", "EUR"]},
        },
        "required": ["price", "currency"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 5}, "maxItems": 5},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    {"enum": ["yes", "no", "maybe"]},
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "object", "properties": {"c": S}, "required": ["c"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {
            "result": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "ok": {"const": True},
                            "value": {"type": "integer", "minimum": 0, "maximum": 9},
                        },
                        "required": ["ok", "value"],
                    },
                    {
                        "type": "object",
                        "properties": {"ok": {"const": False}, "error": S},
                        "required": ["ok", "error"],
                    },
                ]
            }
        },
        "required": ["result"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["code"],
    },
    {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["word"],
    },
    {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"],
            }
        },
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
        "required": ["from", "to"],
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                },
            }
        },
        "required": ["matrix"],
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99},
            "label": S,
            "active": {"type": "boolean"},
            "weight": {"type": "number", "minimum": 0, "maximum": 5},
        },
        "required": ["id", "label", "active"],
    },
]
assert len(SCHEMAS) == 25

# Two function tools in OpenAI's shape, with bounded arguments (see above), for the tool tests.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
        },
    },
}

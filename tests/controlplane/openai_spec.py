"""Validate Hearth's responses against OpenAI's published OpenAPI spec (shared/reference)."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

# The team's shared/ folder lies beside the repository (as in CI); HEARTH_OPENAI_SPEC overrides.
SPEC_PATH = Path(
    os.environ.get(
        "HEARTH_OPENAI_SPEC",
        Path(__file__).resolve().parents[3] / "shared" / "reference" / "openai-openapi.json",
    )
)


def _nullable_as_json_schema(node):
    """OpenAI's spec still marks some fields with OpenAPI 3.0's `nullable: true`, which JSON
    Schema 2020-12 ignores: rewrite each as the JSON Schema equivalent, `null` allowed."""
    if isinstance(node, list):
        return [_nullable_as_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable_as_json_schema(v) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        if isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
            if "enum" in node and None not in node["enum"]:
                node["enum"] = [*node["enum"], None]
        elif "type" not in node:
            return {"anyOf": [node, {"type": "null"}]}
    return node


@cache
def _registry() -> tuple[Registry, dict]:
    if not SPEC_PATH.is_file():
        raise FileNotFoundError(
            f"OpenAI's OpenAPI spec is not at {SPEC_PATH}: these tests need shared/ beside the "
            "repository, or HEARTH_OPENAI_SPEC pointing at openai-openapi.json"
        )
    spec = _nullable_as_json_schema(json.loads(SPEC_PATH.read_text()))
    root = Resource.from_contents(spec, default_specification=DRAFT202012)
    return Registry().with_resource("openai.json", root), spec


def validate(payload: dict, schema_name: str) -> None:
    """Raise jsonschema.ValidationError unless `payload` is a valid `schema_name` object."""
    registry, _ = _registry()
    schema = {"$ref": f"openai.json#/components/schemas/{schema_name}"}
    jsonschema.Draft202012Validator(schema, registry=registry).validate(payload)

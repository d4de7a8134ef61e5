"""Validate Hearth's responses against OpenAI's published OpenAPI spec (shared/reference)."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from controlplane.openapi.vendor import nullable_as_null_type

# The team's shared/ folder lies beside the repository (as in CI); HEARTH_OPENAI_SPEC overrides.
SPEC_PATH = Path(
    os.environ.get(
        "HEARTH_OPENAI_SPEC",
        Path(__file__).resolve().parents[3] / "shared" / "reference" / "openai-openapi.json",
    )
)


@cache
def _registry() -> tuple[Registry, dict]:
    if not SPEC_PATH.is_file():
        raise FileNotFoundError(
            f"OpenAI's OpenAPI spec is not at {SPEC_PATH}: these tests need shared/ beside the "
            "repository, or HEARTH_OPENAI_SPEC pointing at openai-openapi.json"
        )
    spec = nullable_as_null_type(json.loads(SPEC_PATH.read_text()))
    root = Resource.from_contents(spec, default_specification=DRAFT202012)
    return Registry().with_resource("openai.json", root), spec


def validate(payload: dict, schema_name: str) -> None:
    """Raise jsonschema.ValidationError unless `payload` is a valid `schema_name` object."""
    registry, _ = _registry()
    schema = {"$ref": f"openai.json#/components/schemas/{schema_name}"}
    jsonschema.Draft202012Validator(schema, registry=registry).validate(payload)

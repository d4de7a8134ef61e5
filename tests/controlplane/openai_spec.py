"""Validate Hearth's responses against OpenAI's published OpenAPI spec.

The spec is committed, gzipped, as tests/reference/openai-openapi.json.gz (openai-openapi.json
from the openai/openai-openapi repository), so a clone needs nothing beside the repository;
HEARTH_OPENAI_SPEC names another copy (plain JSON, or gzipped when it ends in .gz).
"""

from __future__ import annotations

import gzip
import json
import os
from functools import cache
from pathlib import Path

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from controlplane.openapi.vendor import nullable_as_null_type

SPEC_PATH = Path(
    os.environ.get(
        "HEARTH_OPENAI_SPEC",
        Path(__file__).resolve().parents[1] / "reference" / "openai-openapi.json.gz",
    )
)


def openai_spec() -> dict:
    """OpenAI's OpenAPI document, as published."""
    raw = SPEC_PATH.read_bytes()
    return json.loads(gzip.decompress(raw) if SPEC_PATH.suffix == ".gz" else raw)


@cache
def _registry() -> tuple[Registry, dict]:
    spec = nullable_as_null_type(openai_spec())
    root = Resource.from_contents(spec, default_specification=DRAFT202012)
    return Registry().with_resource("openai.json", root), spec


def validate(payload: dict, schema_name: str) -> None:
    """Raise jsonschema.ValidationError unless `payload` is a valid `schema_name` object."""
    registry, _ = _registry()
    schema = {"$ref": f"openai.json#/components/schemas/{schema_name}"}
    jsonschema.Draft202012Validator(schema, registry=registry).validate(payload)

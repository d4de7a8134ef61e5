"""Write `openai_subset.json`: the component schemas of OpenAI's published OpenAPI document that
Hearth's own document uses, with everything they reference.

Run it when OpenAI's spec changes (the result is committed; nothing reads the full spec at run
time):

    python -m controlplane.openapi.vendor /path/to/openai-openapi.json

Two rewrites, both lossless for what Hearth documents: OpenAI's spec is OpenAPI 3.1 (JSON Schema
2020-12) but still marks some fields with 3.0's `nullable: true`, which 3.1 ignores; each becomes
the 3.1 form (`null` allowed). And the `x-oaiMeta` blocks (examples for OpenAI's docs site) are
dropped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SUBSET_PATH = Path(__file__).with_name("openai_subset.json")

# What Hearth's document refers to; the schemas these reference come along.
ROOTS = (
    "CreateChatCompletionRequest",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionRequest",
    "CreateCompletionResponse",
    "CompletionUsage",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
    "Batch",
    "ListBatchesResponse",
    "CreateBatchRequest",
    "OpenAIFile",
    "CreateFileRequest",
    "DeleteFileResponse",
)


def nullable_as_null_type(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true` rewritten as JSON Schema's `null` type (or `anyOf` with
    `{"type": "null"}` where the schema has no single type)."""
    if isinstance(node, list):
        return [nullable_as_null_type(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {k: nullable_as_null_type(v) for k, v in node.items() if k != "x-oaiMeta"}
    if node.pop("nullable", False) is True:
        if isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
            if "enum" in node and None not in node["enum"]:
                node["enum"] = [*node["enum"], None]
        elif "type" not in node:
            return {"anyOf": [node, {"type": "null"}]}
    return node


def _references(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*(_references(item) for item in node)) if node else set()
    if not isinstance(node, dict):
        return set()
    found = {node["$ref"].rsplit("/", 1)[-1]} if isinstance(node.get("$ref"), str) else set()
    return found.union(*(_references(value) for value in node.values()))


def subset(spec: dict, roots: tuple[str, ...] = ROOTS) -> dict[str, Any]:
    """`roots` and every component schema they reach, rewritten, sorted by name."""
    schemas = spec["components"]["schemas"]
    chosen: dict[str, Any] = {}
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name in chosen:
            continue
        chosen[name] = nullable_as_null_type(schemas[name])
        pending.extend(_references(schemas[name]))
    return dict(sorted(chosen.items()))


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m controlplane.openapi.vendor OPENAI_OPENAPI_JSON")
    spec = json.loads(Path(argv[0]).read_text())
    document = {
        "source": "openai/openai-openapi, components/schemas (see controlplane/openapi/vendor.py)",
        "openapi": spec["openapi"],
        "info_version": spec["info"]["version"],
        "schemas": subset(spec),
    }
    SUBSET_PATH.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(document['schemas'])} schemas written to {SUBSET_PATH}")


if __name__ == "__main__":
    main(sys.argv[1:])

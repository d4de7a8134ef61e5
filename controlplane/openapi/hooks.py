"""drf-spectacular's postprocessing hook: the whole API in the document it generated.

drf-spectacular introspects the DRF views, which have no serializers, so it knows their paths,
path parameters and methods but not their bodies; it does not see the async views (completions,
the event stream) or plain Django ones (health) at all. `describe_api` adds those, lays
`operations.OPERATIONS` over every operation, and adds the component schemas, error responses,
headers and the Bearer security scheme. A generated operation without an entry in OPERATIONS is
an error, not an undocumented endpoint.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension

from controlplane.openapi.operations import ERROR_DESCRIPTIONS, OPERATIONS
from controlplane.openapi.schemas import hearth_schemas, openai_schemas, ref

HTTP_METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")


class UndocumentedOperation(Exception):
    """The URLconf has an operation that controlplane/openapi/operations.py does not describe."""


SECURITY_SCHEME = {"type": "http", "scheme": "bearer", "description": "An API key, `hk_…`."}


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    """Tells drf-spectacular what `ApiKeyAuthentication` is: a Bearer API key."""

    target_class = "controlplane.api.auth.ApiKeyAuthentication"
    name = "ApiKeyAuth"

    def get_security_definition(self, auto_schema):
        return SECURITY_SCHEME


COMPONENT_HEADERS = {
    "x-request-id": {
        "description": "The request's id (`req_…`); its job and usage row carry it.",
        "schema": {"type": "string"},
    },
    "x-hearth-node": {
        "description": "The node that served the request (when one started it); when the request "
        "was split between a prefill and a decode node, the one that decoded it.",
        "schema": {"type": "string"},
    },
    "x-hearth-prefill-node": {
        "description": "The node that computed the prompt, only when the request was split "
        "between a prefill node and the decode node `x-hearth-node` names.",
        "schema": {"type": "string"},
    },
    "x-hearth-cached-tokens": {
        "description": "Prompt tokens that came from the node's prefix cache.",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    },
    "retry-after": {
        "description": "Seconds to wait before retrying.",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    },
}

COMPONENT_PARAMETERS = {
    "x-session-affinity": {
        "name": "x-session-affinity",
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": "An opaque session id: every request of the session goes to the same "
        "node while it is healthy, so its prefix cache keeps hitting.",
    },
    "Idempotency-Key": {
        "name": "Idempotency-Key",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
        "description": "The same key and body replay the first response "
        "(`idempotent-replayed: true`); the same key with another body is a 409.",
    },
}


def _error_responses() -> dict[str, Any]:
    responses = {}
    for status, description in ERROR_DESCRIPTIONS.items():
        response: dict[str, Any] = {
            "description": description,
            "content": {"application/json": {"schema": ref("ErrorResponse")}},
        }
        if status == 429:
            response["headers"] = {"retry-after": {"$ref": "#/components/headers/retry-after"}}
        responses[f"Error{status}"] = response
    return responses


def _path_parameters(path: str, generated: list[dict]) -> list[dict]:
    """drf-spectacular's path parameters, as plain strings (our ids are opaque)."""
    return [
        {**parameter, "schema": {"type": "string"}}
        for parameter in generated
        if parameter.get("in") == "path" and f"{{{parameter['name']}}}" in path
    ]


def describe_api(result: dict[str, Any], generator, request, public) -> dict[str, Any]:
    """POSTPROCESSING_HOOKS entry: complete the document drf-spectacular generated."""
    generated = result.get("paths", {})
    undocumented = [
        f"{method.upper()} {path}"
        for path, item in generated.items()
        for method in item
        if method in HTTP_METHODS and (path, method) not in OPERATIONS
    ]
    if undocumented:
        raise UndocumentedOperation(
            f"Add these to controlplane/openapi/operations.py: {', '.join(undocumented)}"
        )
    paths: dict[str, dict[str, Any]] = {}
    for (path, method), described in sorted(OPERATIONS.items()):
        spectacular = generated.get(path, {}).get(method, {})
        operation = {**described}
        parameters = _path_parameters(path, spectacular.get("parameters", []))
        parameters += described.get("parameters", [])
        if parameters:
            operation["parameters"] = parameters
        paths.setdefault(path, {})[method] = operation
    result["paths"] = paths
    components = result.setdefault("components", {})
    components["schemas"] = {**openai_schemas(), **hearth_schemas()}
    components["responses"] = _error_responses()
    components["headers"] = COMPONENT_HEADERS
    components["parameters"] = COMPONENT_PARAMETERS
    components["securitySchemes"] = {"ApiKeyAuth": SECURITY_SCHEME}
    result["security"] = [{"ApiKeyAuth": []}]
    return result

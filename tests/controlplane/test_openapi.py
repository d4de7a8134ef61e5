"""`GET /openapi.json`: served without a key, valid OpenAPI 3.1, every API URL in it with its
errors, Hearth's extensions described, and Hearth's objects as the document says (schemathesis
checks the rest against a live stack: tests/e2e/test_openapi_schemathesis.py)."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import jsonschema
import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone
from drf_spectacular.validation import validate_schema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from controlplane.jobs.models import Job
from controlplane.openapi import vendor
from controlplane.openapi.hooks import UndocumentedOperation, describe_api
from tests.controlplane.openai_spec import openai_spec


@pytest.fixture
def document(client) -> dict:
    response = client.get("/openapi.json", HTTP_AUTHORIZATION="Bearer not-a-key")
    assert response.status_code == 200
    assert response["content-type"].startswith("application/json")
    return response.json()


def api_routes(resolver=None, prefix: str = "") -> list[tuple[str, object]]:
    """(OpenAPI path, view) of every URL pattern under /v1, /healthz and /metrics."""
    routes = []
    for pattern in (resolver or get_resolver()).url_patterns:
        route = prefix + str(pattern.pattern)
        if isinstance(pattern, URLResolver):
            routes += api_routes(pattern, route)
        elif isinstance(pattern, URLPattern) and route.startswith(("v1/", "healthz", "metrics")):
            routes.append(("/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route), pattern.callback))
    return routes


def schema_validator(document: dict, name: str) -> jsonschema.Draft202012Validator:
    root = Resource.from_contents(document, default_specification=DRAFT202012)
    registry = Registry().with_resource("hearth.json", root)
    return jsonschema.Draft202012Validator(
        {"$ref": f"hearth.json#/components/schemas/{name}"}, registry=registry
    )


def test_it_is_served_without_a_key_as_valid_openapi_3_1(document):
    assert document["openapi"].startswith("3.1")
    validate_schema(document)
    for schema in document["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_every_reference_resolves(document):
    text = json.dumps(document)
    for reference in set(re.findall(r'"\$ref": "#/([^"]+)"', text)):
        node = document
        for part in reference.split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]


def test_every_api_url_is_documented_with_each_method_it_answers(document):
    routes = api_routes()
    assert len(routes) >= 20  # the walk found the API
    for path, view in routes:
        assert path in document["paths"], f"{path} is not in /openapi.json"
        documented = set(document["paths"][path])
        drf_view = getattr(view, "cls", None)
        if drf_view is not None:  # a DRF view says which methods it answers
            answered = {
                m for m in ("get", "post", "delete", "put", "patch") if hasattr(drf_view, m)
            }
            assert answered == documented, path


def test_every_operation_documents_its_errors_in_openais_shape(document):
    responses = document["components"]["responses"]
    for path, item in document["paths"].items():
        for method, operation in item.items():
            codes = set(operation["responses"])
            assert any(code.startswith("2") for code in codes), (method, path)
            if path in ("/healthz", "/metrics"):
                assert operation["security"] == []
                continue
            assert "401" in codes, (method, path)
            for code in codes - {"200", "201", "202"}:
                error = responses[operation["responses"][code]["$ref"].rsplit("/", 1)[-1]]
                schema = error["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert document["security"] == [{"ApiKeyAuth": []}]
    assert document["components"]["securitySchemes"]["ApiKeyAuth"]["scheme"] == "bearer"


def test_it_describes_hearths_extensions(document):
    schemas = document["components"]["schemas"]
    extensions = schemas["HearthCompletionFields"]["properties"]
    for name in ("queue", "reject_if_busy", "deadline_s", "top_k", "min_p", "repetition_penalty"):
        assert name in extensions
    chat = document["paths"]["/v1/chat/completions"]["post"]
    parameters = {p["$ref"].rsplit("/", 1)[-1] for p in chat["parameters"]}
    assert parameters == {"x-session-affinity", "Idempotency-Key"}
    assert set(chat["responses"]["200"]["headers"]) == {
        "x-request-id",
        "x-hearth-node",
        "x-hearth-prefill-node",
        "x-hearth-cached-tokens",
    }
    assert chat["responses"]["202"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/Job"
    )
    # OpenAI's chat request as OpenAI publishes it, tools and structured outputs included.
    openai_chat = schemas["CreateChatCompletionRequest"]["allOf"][1]["properties"]
    for name in ("tools", "tool_choice", "parallel_tool_calls", "response_format", "n"):
        assert name in openai_chat
    assert "pricing" in schemas["HearthModel"]["allOf"][1]["properties"]


def test_an_operation_missing_from_the_table_fails_the_build():
    generated = {"paths": {"/v1/frobnicate": {"post": {"responses": {}}}}}
    with pytest.raises(UndocumentedOperation, match="POST /v1/frobnicate"):
        describe_api(generated, None, None, True)


def test_the_vendored_subset_is_openais_current_spec():
    spec = openai_spec()
    assert json.loads(vendor.SUBSET_PATH.read_text())["schemas"] == vendor.subset(spec)


@pytest.mark.parametrize("endpoint", [Job.CHAT, Job.TEXT])
def test_a_job_object_is_what_the_document_says(api, document, org_a, key_a, smollm2, endpoint):
    # A chat job once showed `endpoint: "/v1/chat.completions"` (found by schemathesis).
    [job] = Job.objects.submit_all(
        [
            Job(
                org=org_a,
                model=smollm2.id,
                endpoint=endpoint,
                mode=Job.ASYNC,
                request={},
                prompt_token_ids=[3, 4, 5],
                sampling={"max_tokens": 4},
                deadline_at=timezone.now() + timedelta(hours=1),
            )
        ]
    )
    body = api.get(f"/v1/jobs/{job.id}", key_a).json()
    schema_validator(document, "Job").validate(body)
    assert (
        body["endpoint"]
        == {Job.CHAT: "/v1/chat/completions", Job.TEXT: "/v1/completions"}[endpoint]
    )
    listed = api.get("/v1/jobs", key_a).json()
    schema_validator(document, "JobList").validate(listed)

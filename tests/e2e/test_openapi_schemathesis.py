"""schemathesis against the live API, as `/openapi.json` describes it: the production stack
(uvicorn, a node with tiny random weights, the worker), every operation, positive and negative
cases, with a real API key. No response may be a 5xx, and none may contradict the document.

The cases are schemathesis' own; the test only steers some of them towards the happy path, with
draws Hypothesis makes (so a run is reproducible): the catalog's model in place of a generated
model id, ids of real objects in place of generated ids, a real file for a batch. Without that
nearly every case would be a 404 and the documented success bodies would go unchecked.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from controlplane.accounts.models import ApiKey, Org
from controlplane.events.models import Event

pytestmark = pytest.mark.django_db(transaction=True)

CHECKS = [not_a_server_error, response_schema_conformance]
# Generated cases per operation and mode (the documented examples come on top): about 700
# requests in all, under two minutes here.
EXAMPLES = {GenerationMode.POSITIVE: 15, GenerationMode.NEGATIVE: 8}
# A tiny model answers any request within seconds: a request that takes longer is a failure,
# reported as such, not a test that hangs.
REQUEST_TIMEOUT_S = 30
# The event stream never ends: schemathesis reads it for this long, then judges what came.
STREAM_READ_S = 2.0
# Operations that change the org's budget or a key's limits run last, so a budget of 0 drawn
# for them does not turn every later completion into a 402.
LAST = ("/v1/budget", "/v1/api_keys/{prefix}/limits")


def _api(base_url: str, key: str):
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key}"

    def call(method: str, path: str, **kwargs) -> dict:
        response = session.request(method, f"{base_url}{path}", timeout=60, **kwargs)
        assert response.status_code < 300, (path, response.status_code, response.text)
        return response.json()

    return call


def _batch_file(model: str) -> bytes:
    lines = [
        {
            "custom_id": f"line-{index}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": f"hello {index}"}],
                "max_tokens": 4,
            },
        }
        for index in range(2)
    ]
    return "\n".join(json.dumps(line) for line in lines).encode()


def real_objects(base_url: str, key: str, model: str, org: Org) -> dict[str, list[str]]:
    """Objects of the key's org, created through the API: per path parameter, ids the cases may
    use (for DELETE, ids of their own, so a deletion does not take another case's object)."""
    call = _api(base_url, key)
    job = call(
        "POST",
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "queue": True,
        },
    )
    upload = {"purpose": (None, "batch")}
    kept = call("POST", "/v1/files", files={**upload, "file": ("a.jsonl", _batch_file(model))})
    doomed = call("POST", "/v1/files", files={**upload, "file": ("b.jsonl", _batch_file(model))})
    batch = call(
        "POST",
        "/v1/batches",
        json={
            "input_file_id": kept["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    hook = {"url": "http://127.0.0.1:9/hook", "event_types": ["batch.completed"]}
    endpoint = call("POST", "/v1/webhook_endpoints", json=hook)
    doomed_endpoint = call("POST", "/v1/webhook_endpoints", json=hook)
    invoices = call("GET", "/v1/invoices")["data"]
    # A key of the org other than the one the cases use: its limits may be set to anything.
    other_key, _ = ApiKey.objects.create_key(org, "limits-target")
    return {
        "job_id": [job["id"]],
        "file_id": [kept["id"]],
        "batch_id": [batch["id"]],
        "endpoint_id": [endpoint["id"]],
        "invoice_id": [invoice["id"] for invoice in invoices],
        "model_id": [model],
        "prefix": [other_key.prefix],
        "after": [Event.objects.filter(org=org).order_by("sequence").first().id, job["id"]],
        "DELETE file_id": [doomed["id"]],
        "DELETE endpoint_id": [doomed_endpoint["id"]],
    }


def steer(case, choose, model: str, ids: dict[str, list[str]]) -> None:
    """Replace generated ids with real ones and a generated model id with the served one, where
    `choose(choices)` picks one (it may pick None: keep what was generated)."""
    method = case.operation.method.upper()
    for name in list(case.path_parameters or {}):
        real = choose(ids.get(f"{method} {name}") or ids.get(name) or [])
        if real is not None:
            case.path_parameters[name] = real
    if isinstance(case.query, dict) and "after" in case.query:
        case.query["after"] = choose(ids["after"]) or case.query["after"]
    if isinstance(case.body, dict):
        if isinstance(case.body.get("model"), str):
            case.body["model"] = choose([model]) or case.body["model"]
        if "input_file_id" in case.body:
            case.body["input_file_id"] = choose(ids["file_id"]) or case.body["input_file_id"]


def drawn(draw):
    """`choose` for generated cases: a Hypothesis draw, which may keep the generated value."""
    return lambda choices: draw(st.sampled_from([None, *choices])) if choices else None


def first(choices: list[str]) -> str | None:
    """`choose` for the documented examples: always a real id and the served model."""
    return choices[0] if choices else None


def run_cases(strategy, examples: int, call) -> str | None:
    """Run `call(case, draw)` on `examples` cases from `strategy`; the first failure, or None."""

    @given(case=strategy, data=st.data())
    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        # No shrinking: each step would be another request to a live server.
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def cases(case, data):
        call(case, data.draw)

    try:
        cases()
    except Unsatisfiable:
        return None  # nothing to negate (an operation without parameters or body)
    # schemathesis raises its check failures as an ExceptionGroup of them.
    except (Exception, BaseExceptionGroup) as failure:
        return str(failure)
    return None


def test_every_operation_answers_as_documented(stack, tiny_model, acme_key):
    stack.start_node(tiny_model.id, "node-a", threads=1)
    stack.wait_ready(tiny_model.id, nodes=1, api_key=acme_key)
    org = Org.objects.get(slug="acme")
    ids = real_objects(stack.url, acme_key, tiny_model.id, org)
    document = requests.get(f"{stack.url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    operations.sort(key=lambda operation: operation.path in LAST)
    assert len(operations) >= 30
    statuses: Counter = Counter()

    def call(operation, case, draw, choose) -> None:
        steer(case, choose, tiny_model.id, ids)
        # One case in eight goes without a key: the 401s are documented too.
        authorized = draw(st.integers(0, 7)) != 7
        headers = {"Authorization": f"Bearer {acme_key}"} if authorized else {}
        timeout = STREAM_READ_S if operation.path == "/v1/events" else REQUEST_TIMEOUT_S
        response = case.call(base_url=stack.url, headers=headers, timeout=timeout)
        statuses[operation.label, response.status_code] += 1
        case.validate_response(response, checks=CHECKS, headers=headers)

    failures = []
    for operation in operations:
        runs = [
            (f"example {index}", strategy, 1, True)
            for index, strategy in enumerate(schema.get_strategies_from_examples(operation))
        ]
        runs += [
            (mode.value, operation.as_strategy(generation_mode=mode), examples, False)
            for mode, examples in EXAMPLES.items()
        ]
        for name, strategy, examples, documented in runs:
            failure = run_cases(
                strategy,
                examples,
                lambda case, draw, documented=documented, operation=operation: call(
                    operation, case, draw, first if documented else drawn(draw)
                ),
            )
            if failure is not None:
                failures.append(f"{operation.label} ({name}): {failure}")
    for (label, status), count in sorted(statuses.items()):
        print(f"{label:60} {status} x{count}")
    if failures and os.environ.get("HEARTH_SHOW_STACK_LOGS"):
        print(stack.outputs())
    assert not failures, "\n\n".join(failures)
    # The steering works: completions reached the node, synchronously and queued.
    assert statuses["POST /v1/chat/completions", 200] and statuses["POST /v1/completions", 200]
    assert statuses["POST /v1/chat/completions", 202]

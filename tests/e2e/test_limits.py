"""Rate limits and budgets on the production stack: uvicorn against real Redis (the buckets) and
PostgreSQL (the budgets), seen through plain HTTP and the official `openai` SDK."""

from __future__ import annotations

import http.client
import json
from decimal import Decimal

import openai
import pytest

from controlplane.accounts.models import ApiKey, Org
from controlplane.jobs.models import Job

pytestmark = pytest.mark.django_db(transaction=True)

N = 5


def limit_key(key: str, **limits) -> None:
    ApiKey.objects.filter(prefix=key.split("_")[1]).update(**limits)


def post_job(port: int, key: str, model: str, max_tokens: int = 8):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"model": model, "prompt": "hello", "max_tokens": max_tokens, "queue": True}
    connection.request(
        "POST",
        "/v1/completions",
        json.dumps(body),
        {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    response = connection.getresponse()
    payload = json.loads(response.read())
    connection.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, payload


def test_a_burst_past_the_request_limit_passes_exactly_the_limit(stack, tiny_model, acme_key):
    limit_key(acme_key, requests_per_minute=N)
    stack.wait_ready(tiny_model.id, nodes=0, api_key=acme_key)
    answers = [post_job(stack.port, acme_key, tiny_model.id) for _ in range(N + 5)]

    passed = [a for a in answers if a[0] == 202]
    refused = [a for a in answers if a[0] != 202]
    assert len(passed) == N and answers[:N] == passed  # the first N, in order
    remaining = [int(headers["x-ratelimit-remaining-requests"]) for _, headers, _ in passed]
    assert remaining == list(range(N - 1, -1, -1))
    assert all(headers["x-ratelimit-limit-requests"] == str(N) for _, headers, _ in answers)
    for status, headers, payload in refused:
        assert status == 429 and payload["error"]["code"] == "rate_limit_exceeded"
        assert payload["error"]["type"] == "rate_limit_error"
        assert int(headers["retry-after"]) >= 1
        assert headers["x-ratelimit-remaining-requests"] == "0"
    assert Job.objects.count() == N  # a refused request writes nothing

    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=acme_key, max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused_by_sdk:
        client.completions.create(model=tiny_model.id, prompt="hello", max_tokens=8)
    assert refused_by_sdk.value.code == "rate_limit_exceeded"


def test_the_token_limit_counts_prompt_and_max_tokens(stack, tiny_model, acme_key):
    limit_key(acme_key, tokens_per_minute=100)
    stack.wait_ready(tiny_model.id, nodes=0, api_key=acme_key)
    status, headers, _ = post_job(stack.port, acme_key, tiny_model.id, max_tokens=40)
    assert status == 202
    left = int(headers["x-ratelimit-remaining-tokens"])
    assert 100 - 40 - 10 < left < 100 - 40  # the prompt is a few tokens
    status, headers, payload = post_job(stack.port, acme_key, tiny_model.id, max_tokens=left)
    assert status == 429 and payload["error"]["code"] == "rate_limit_exceeded"
    status, headers, payload = post_job(stack.port, acme_key, tiny_model.id, max_tokens=150)
    assert status == 429 and "Request too large" in payload["error"]["message"]
    assert "retry-after" not in headers  # waiting would not help


def test_a_request_past_the_budget_is_refused_through_the_sdk(stack, tiny_model, acme_key):
    Org.objects.filter(slug="acme").update(monthly_budget_usd=Decimal("0.000010"))
    stack.wait_ready(tiny_model.id, nodes=0, api_key=acme_key)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=acme_key, max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(
            model=tiny_model.id, prompt="hello", max_tokens=100, extra_body={"queue": True}
        )
    assert refused.value.status_code == 402
    assert refused.value.body["code"] == "budget_exceeded"
    assert not Job.objects.exists()

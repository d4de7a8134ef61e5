"""Bad input to the completion endpoints: OpenAI's error shape, the right status, and no row.

No node runs here: every refusal must happen before anything is queued. The views run admission
in a worker thread with its own database connection, so these tests commit their fixtures
(transaction=True) for that thread to see them.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.accounts.models import ApiKey
from controlplane.billing.models import UsageRecord
from controlplane.events.models import Event
from controlplane.jobs.models import Job
from tests.controlplane.openai_spec import validate

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], **fields}


def assert_refused(response, status: int, code: str | None, param: str | None = None) -> dict:
    assert response.status_code == status, response.content
    body = response.json()
    validate(body, "ErrorResponse")
    if code is not None:
        assert body["error"]["code"] == code
    if param is not None:
        assert body["error"]["param"] == param
    assert not Job.objects.exists() and not UsageRecord.objects.exists()
    assert not Event.objects.exists()
    return body


def test_it_refuses_a_request_without_a_key(post, tiny):
    assert_refused(post(CHAT, chat()), 401, "missing_api_key")


def test_it_refuses_a_malformed_key(post, tiny):
    assert_refused(post(CHAT, chat(), key="hk_nothex_short"), 401, "invalid_api_key")


def test_it_refuses_a_revoked_key(post, tiny, key_a):
    ApiKey.objects.get().revoke()
    assert_refused(post(CHAT, chat(), key=key_a), 401, "revoked_api_key")


def test_it_refuses_an_expired_key(post, tiny, key_a):
    ApiKey.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert_refused(post(TEXT, {"model": "tiny", "prompt": "hi"}, key=key_a), 401, "expired_api_key")


def test_it_refuses_malformed_json(post, tiny, key_a):
    assert_refused(post(CHAT, b'{"model": "tiny",', key=key_a, raw=True), 400, "invalid_json")


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"temperature": "hot"}, "temperature", "invalid_type"),
        ({"max_tokens": "5"}, "max_tokens", "invalid_type"),
        ({"stream": "yes"}, "stream", "invalid_type"),
        ({"messages": "hello"}, "messages", "invalid_type"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "invalid_value"),
        ({"stop": [1, 2]}, "stop", "invalid_type"),
        ({"top_p": 0}, "top_p", "invalid_value"),
        ({"model": 7}, "model", "invalid_type"),
        ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({"deadline_s": "1h"}, "deadline_s", "invalid_type"),
        ({"deadline_s": 0}, "deadline_s", "invalid_value"),
        ({"deadline_s": 8 * 24 * 3600}, "deadline_s", "invalid_value"),
    ],
)
def test_it_names_the_field_of_the_wrong_type_or_value(post, tiny, key_a, fields, param, code):
    assert_refused(post(CHAT, chat(**fields), key=key_a), 400, code, param)


def test_it_refuses_an_unknown_model(post, tiny, key_a):
    assert_refused(post(CHAT, chat(model="gpt-9"), key=key_a), 404, "model_not_found", "model")


def test_it_refuses_a_prompt_over_the_context_length(post, tiny, key_a):
    long_prompt = "hello world " * 100
    body = {"model": "tiny", "prompt": long_prompt}
    assert_refused(post(TEXT, body, key=key_a), 400, "context_length_exceeded", "prompt")


def test_it_refuses_max_tokens_beyond_the_context(post, tiny, key_a):
    body = chat(max_tokens=64)
    assert_refused(post(CHAT, body, key=key_a), 400, "context_length_exceeded", "max_tokens")


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_it_refuses_max_tokens_below_one(post, tiny, key_a, max_tokens):
    body = chat(max_tokens=max_tokens)
    assert_refused(post(CHAT, body, key=key_a), 400, "invalid_value", "max_tokens")


def test_it_refuses_features_that_are_not_built_yet(post, tiny, key_a):
    body = chat(functions=[{"name": "lookup", "parameters": {"type": "object"}}])
    assert_refused(post(CHAT, body, key=key_a), 400, "unsupported", "functions")


def test_reject_if_busy_refuses_at_once_when_no_node_has_room(post, tiny, key_a):
    response = post(CHAT, chat(reject_if_busy=True), key=key_a)
    assert_refused(response, 429, "out_of_capacity")
    assert int(response["retry-after"]) >= 1


def test_another_orgs_job_is_not_found(api, tiny, org_a, key_b):
    job = Job.objects.create(
        org=org_a, model="tiny", request={}, prompt_token_ids=[1, 2], sampling={}
    )
    response = api.get(f"/v1/jobs/{job.id}", key_b)
    assert response.status_code == 404
    validate(response.json(), "ErrorResponse")
    assert response.json()["error"]["code"] == "job_not_found"


def test_a_queued_job_keeps_the_deadline_it_asked_for(post, tiny, key_a):
    response = post(CHAT, chat(queue=True, deadline_s=120), key=key_a)
    assert response.status_code == 202
    job = Job.objects.get(id=response.json()["id"])
    remaining = (job.deadline_at - job.created).total_seconds()
    assert 119 <= remaining <= 121 and response.json()["deadline_at"] is not None


def test_start_up_loads_the_catalogs_tokenizers_and_skips_a_broken_one(tiny):
    from controlplane.catalog.models import ServedModel
    from controlplane.dispatch import tokenization

    ServedModel.objects.create(id="gone", source="/nonexistent/weights", context_length=64)
    ServedModel.objects.create(id="off", source="/also/missing", context_length=64, enabled=False)
    tokenization._tokenizer.cache_clear()
    tokenization.load_catalog_tokenizers()
    # tiny's tokenizer is loaded; the broken model was tried and left to its first request.
    assert tokenization._tokenizer.cache_info().currsize == 1
    assert tokenization._tokenizer.cache_info().misses == 2

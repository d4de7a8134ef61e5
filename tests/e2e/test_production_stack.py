"""The whole path in production mode, driven by the official `openai` package: uvicorn, a node
process and the worker process, on PostgreSQL and Redis."""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest

from controlplane.billing.models import UsageRecord
from controlplane.jobs.models import Job
from tests.controlplane.openai_spec import validate

pytestmark = pytest.mark.django_db(transaction=True)

# Long enough to fill several 16-token KV blocks, so a repeat can hit the prefix cache.
LONG_SYSTEM = (
    "You are a careful code reviewer. Read the diff, find the bugs, and explain each one "
    "briefly with the line it is on. " * 2
)


def get_json(url: str, key: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def wait_for(predicate, timeout_s: float = 60, what: str = "condition"):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_openai_sdk_drives_the_production_stack(stack, tiny_model, acme_key):
    stack.start_node(tiny_model.id, "node-a")
    stack.wait_ready(tiny_model.id, nodes=1, api_key=acme_key)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=acme_key, max_retries=0)
    request_ids = []

    try:
        # The catalog, with prices.
        [listed] = [m for m in client.models.list().data if m.id == tiny_model.id]
        assert listed.model_extra["pricing"]["cached_input"] == "0.1"

        # A synchronous chat completion, not streamed.
        raw = client.chat.completions.with_raw_response.create(
            model=tiny_model.id,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            temperature=0,
        )
        completion = raw.parse()
        validate(raw.http_response.json(), "CreateChatCompletionResponse")
        assert raw.headers["x-hearth-node"] == "node-a"
        assert raw.headers["x-request-id"].startswith("req_")
        assert completion.choices[0].finish_reason in ("stop", "length")
        assert completion.usage.completion_tokens >= 1
        assert completion.usage.prompt_tokens_details.cached_tokens == 0
        request_ids.append(raw.headers["x-request-id"])

        # The same request streamed, with usage: the same greedy text.
        with client.chat.completions.with_streaming_response.create(
            model=tiny_model.id,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ) as streamed:
            request_ids.append(streamed.headers["x-request-id"])
            chunks = list(streamed.parse())
        for chunk in chunks:
            validate(chunk.model_dump(exclude_unset=True), "CreateChatCompletionStreamResponse")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == completion.choices[0].message.content
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == (
            completion.usage.total_tokens
        )
        assert chunks[-2].choices[0].finish_reason == completion.choices[0].finish_reason

        # A text completion.
        raw_text = client.completions.with_raw_response.create(
            model=tiny_model.id, prompt="The cache", max_tokens=5, temperature=0
        )
        validate(raw_text.http_response.json(), "CreateCompletionResponse")
        assert raw_text.parse().usage.prompt_tokens_details.cached_tokens == 0
        request_ids.append(raw_text.headers["x-request-id"])

        # An async job: 202 at once, then completed with the full completion and its cost.
        queued = client.chat.completions.with_raw_response.create(
            model=tiny_model.id,
            messages=[{"role": "user", "content": "review this"}],
            max_tokens=6,
            temperature=0,
            extra_body={"queue": True},
        )
        assert queued.http_response.status_code == 202
        job = queued.http_response.json()
        assert job["id"].startswith("job_") and job["status"] == "queued"
        request_ids.append(job["request_id"])

        def finished():
            body = get_json(f"{stack.url}/v1/jobs/{job['id']}", acme_key)
            return body if body["status"] in ("completed", "failed") else None

        done = wait_for(finished, what="the queued job")
        assert done["status"] == "completed", done
        validate(done["response"], "CreateChatCompletionResponse")
        assert done["usage"]["completion_tokens"] == 6
        assert done["node"] == "node-a" and done["started_at"] is not None
        record = UsageRecord.objects.get(request_id=job["request_id"])
        assert done["cost"]["total"] == str(record.total_cost.normalize())

        # Affinity: the same long prompt twice in one session; the second hits the cache.
        affinity = {"x-session-affinity": "agent-session-1"}
        cached = []
        for turn in range(2):
            raw_turn = client.chat.completions.with_raw_response.create(
                model=tiny_model.id,
                messages=[
                    {"role": "system", "content": LONG_SYSTEM},
                    {"role": "user", "content": "first file"},
                ],
                max_tokens=4,
                temperature=0,
                extra_headers=affinity,
            )
            usage = raw_turn.parse().usage
            cached.append(usage.prompt_tokens_details.cached_tokens)
            assert raw_turn.headers["x-hearth-cached-tokens"] == str(cached[-1]), turn
            request_ids.append(raw_turn.headers["x-request-id"])
        assert cached[0] == 0 and cached[1] >= 16 * 4, cached
    except Exception:
        print(stack.outputs())
        raise

    # Exactly one usage row per request, each agreeing with the job's usage.
    wait_for(
        lambda: UsageRecord.objects.filter(request_id__in=request_ids).count() == len(request_ids),
        what="every usage row",
    )
    time.sleep(0.5)  # a duplicate row would show up now, not later
    assert UsageRecord.objects.count() == len(request_ids)
    for job in Job.objects.filter(request_id__in=request_ids):
        assert job.status == Job.COMPLETED
        record = UsageRecord.objects.get(request_id=job.request_id)
        assert record.prompt_tokens == job.result["usage"]["prompt_tokens"]
        assert record.cached_tokens == job.result["usage"]["cached_tokens"]
        assert record.completion_tokens == job.result["usage"]["completion_tokens"]

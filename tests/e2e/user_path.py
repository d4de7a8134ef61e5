"""One user's path through Hearth's API with the official `openai` package, the same in
production and embedded mode: the catalog, a chat completion (plain and streamed, with usage), a
text completion, a queued job that completes with its cost, and a session whose repeated long
prompt hits the prefix cache."""

from __future__ import annotations

import json
import time
import urllib.request
from decimal import Decimal

import openai

from tests.controlplane.openai_spec import validate

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


def exercise_user_path(base_url: str, api_key: str, model_id: str, node: str) -> list[str]:
    """Run the path against a live server whose only node for `model_id` is `node`; returns the
    request ids of every billed request."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)
    request_ids = []
    # The catalog, with prices.
    [listed] = [m for m in client.models.list().data if m.id == model_id]
    assert listed.model_extra["pricing"]["cached_input"] == "0.1"

    # A synchronous chat completion, not streamed.
    raw = client.chat.completions.with_raw_response.create(
        model=model_id,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=0,
    )
    completion = raw.parse()
    validate(raw.http_response.json(), "CreateChatCompletionResponse")
    assert raw.headers["x-hearth-node"] == node
    assert raw.headers["x-request-id"].startswith("req_")
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens >= 1
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    request_ids.append(raw.headers["x-request-id"])

    # The same request streamed, with usage: the same greedy text.
    with client.chat.completions.with_streaming_response.create(
        model=model_id,
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
    assert text == completion.choices[0].message.content, (text, completion)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == (
        completion.usage.total_tokens
    )
    assert chunks[-2].choices[0].finish_reason == completion.choices[0].finish_reason

    # A text completion.
    raw_text = client.completions.with_raw_response.create(
        model=model_id, prompt="The cache", max_tokens=5, temperature=0
    )
    validate(raw_text.http_response.json(), "CreateCompletionResponse")
    assert raw_text.parse().usage.prompt_tokens_details.cached_tokens == 0
    request_ids.append(raw_text.headers["x-request-id"])

    # An async job: 202 at once, then completed with the full completion and its cost.
    queued = client.chat.completions.with_raw_response.create(
        model=model_id,
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
        body = get_json(f"{base_url}/v1/jobs/{job['id']}", api_key)
        return body if body["status"] in ("completed", "failed") else None

    done = wait_for(finished, what="the queued job")
    assert done["status"] == "completed", done
    validate(done["response"], "CreateChatCompletionResponse")
    assert done["usage"]["completion_tokens"] == 6
    assert done["node"] == node and done["started_at"] is not None
    assert Decimal(done["cost"]["total"]) == Decimal(done["cost"]["input"]) + Decimal(
        done["cost"]["cached_input"]
    ) + Decimal(done["cost"]["output"])

    # Affinity: the same long prompt twice in one session; the second hits the cache.
    affinity = {"x-session-affinity": "agent-session-1"}
    cached = []
    for turn in range(2):
        raw_turn = client.chat.completions.with_raw_response.create(
            model=model_id,
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
    return request_ids

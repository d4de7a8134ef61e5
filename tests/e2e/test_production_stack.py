"""The whole path in production mode, driven by the official `openai` package: uvicorn, a node
process and the worker process, on PostgreSQL and Redis."""

from __future__ import annotations

import pytest

from controlplane.billing.models import UsageRecord
from controlplane.events.models import Event
from controlplane.jobs.models import Job
from tests.e2e.user_path import exercise_user_path, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_openai_sdk_drives_the_production_stack(stack, tiny_model, acme_key):
    stack.start_node(tiny_model.id, "node-a")
    stack.wait_ready(tiny_model.id, nodes=1, api_key=acme_key)
    try:
        request_ids = exercise_user_path(stack.url, acme_key, tiny_model.id, "node-a")
    except Exception:
        print(stack.outputs())
        raise

    # Exactly one usage row per request, each agreeing with its job.
    wait_for(
        lambda: UsageRecord.objects.filter(request_id__in=request_ids).count() == len(request_ids),
        what="every usage row",
    )
    assert UsageRecord.objects.count() == len(request_ids)
    jobs = Job.objects.filter(request_id__in=request_ids)
    assert jobs.count() == len(request_ids)
    for job in jobs:
        assert job.status == Job.COMPLETED and job.node == "node-a"
        record = UsageRecord.objects.get(request_id=job.request_id)
        usage = job.result["usage"]
        assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (
            usage["prompt_tokens"],
            usage["cached_tokens"],
            usage["completion_tokens"],
        )
        # One event per state change: queued, running, completed.
        types = list(
            Event.objects.filter(data__id=job.id)
            .order_by("sequence")
            .values_list("type", flat=True)
        )
        assert types == ["job.queued", "job.running", "job.completed"], (job.id, types)


def test_the_openai_sdk_runs_a_batch_and_a_cancel_on_the_production_stack(
    stack, tiny_model, acme_key
):
    import io
    import json

    import openai

    stack.start_node(tiny_model.id, "node-a")
    stack.wait_ready(tiny_model.id, nodes=1, api_key=acme_key)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=acme_key, max_retries=0)
    system = "You review code for a living. " * 8  # a shared prefix of several KV blocks
    lines = [
        {
            "custom_id": f"review-{index}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": tiny_model.id,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"change {index}"},
                ],
                "max_tokens": 6,
                "temperature": 0,
            },
        }
        for index in range(4)
    ]
    content = "\n".join(json.dumps(line) for line in lines).encode()
    try:
        uploaded = client.files.create(file=("reviews.jsonl", io.BytesIO(content)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_for(
            lambda: client.batches.retrieve(batch.id).status == "completed",
            what="the batch completed",
        )
        done = client.batches.retrieve(batch.id)
        assert done.request_counts.total == 4 and done.request_counts.completed == 4
        output = [json.loads(x) for x in client.files.content(done.output_file_id).text.split()]
    except Exception:
        print(stack.outputs())
        raise
    assert sorted(line["custom_id"] for line in output) == [f"review-{i}" for i in range(4)]
    usages = [line["response"]["body"]["usage"] for line in output]
    assert all(u["completion_tokens"] >= 1 for u in usages)
    # The lines share their system prompt and reach one node in prefix order; the engine lets
    # the first compute it and the others take it from the cache.
    assert sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) > 0
    jobs = Job.objects.filter(mode=Job.BATCH)
    assert jobs.count() == 4 and UsageRecord.objects.filter(mode=Job.BATCH).count() == 4

    # A queued job cancelled through the generic client: settled cancelled, never billed.
    queued = client.chat.completions.with_raw_response.create(
        model=tiny_model.id,
        messages=[{"role": "user", "content": "never mind"}],
        max_tokens=4,
        extra_body={"queue": True, "deadline_s": 600},
    ).http_response.json()
    cancelled = client.post(f"/jobs/{queued['id']}/cancel", cast_to=object)
    assert cancelled["status"] in ("cancelled", "running", "completed")
    wait_for(
        lambda: Job.objects.get(id=queued["id"]).status in Job.TERMINAL, what="the job settled"
    )
    listed = client.get("/jobs", cast_to=object, options={"params": {"limit": 10}})
    assert queued["id"] in [job["id"] for job in listed["data"]]


def test_a_client_that_hangs_up_mid_stream_stops_its_generation(stack, tiny_llama_dir, acme_key):
    """The gateway cancels the job of a stream whose client went away: the node stops it, and
    it is billed for the tokens generated until then."""
    import http.client
    import json
    import os

    from tests.controlplane.conftest import priced_model

    model = priced_model(f"tiny-long-{os.getpid()}", str(tiny_llama_dir), 1024)
    stack.start_node(model.id, "node-a", threads=1)
    stack.wait_ready(model.id, nodes=1, api_key=acme_key)
    body = {
        "model": model.id,
        "messages": [{"role": "user", "content": "write a long story"}],
        "max_tokens": 900,
        "temperature": 0,
        "stream": True,
    }
    connection = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
    connection.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(body),
        {"Authorization": f"Bearer {acme_key}", "Content-Type": "application/json"},
    )
    response = connection.getresponse()
    assert response.status == 200, response.read()
    request_id = response.getheader("x-request-id")
    while b'"content":"' not in response.readline():
        pass  # up to the first generated text
    # Hang up at once: the worker may not have recorded the node's start notice yet, but the
    # gateway saw the stream come from node-a.
    connection.sock.close()
    connection.close()
    job = Job.objects.get(request_id=request_id)

    try:
        wait_for(lambda: Job.objects.get(pk=job.pk).status == Job.CANCELLED, what="cancelled")
    except Exception:
        # Where it stopped: still running (the cancel never came), or completed (it came late).
        settled = Job.objects.get(pk=job.pk)
        print(settled.status, settled.node, settled.cancel_requested_at, settled.finished_at)
        print(stack.outputs())
        raise
    job.refresh_from_db()
    assert job.result["finish_reason"] == "abort"
    record = UsageRecord.objects.get(request_id=request_id)
    assert 0 < record.completion_tokens < 900
    assert record.completion_tokens == job.result["usage"]["completion_tokens"]
    types = list(
        Event.objects.filter(data__id=job.id).order_by("sequence").values_list("type", flat=True)
    )
    assert types == ["job.queued", "job.running", "job.cancelled"]
    assert job.attempts == 1  # the node's own start notice, arriving later, counted nothing

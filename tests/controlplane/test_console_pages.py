"""The console's fleet, job and batch pages with Django's test client: each shows what the models
hold (jobs settled by the real settlement, batches finalized by the real finalization, a node's
heartbeat written by the node's own heartbeat code into Redis), a job is cancelled once from its
page, another org's job, batch or file is a 404, and a billing viewer sees none of them."""

from __future__ import annotations

import html
import json
import re
import time
import uuid
from datetime import timedelta

import dramatiq
import pytest
import redis
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.models import ApiKey, Membership
from controlplane.billing.models import UsageRecord
from controlplane.billing.pricing import decimal_string
from controlplane.catalog import registry
from controlplane.console.fleet import STALE_AFTER_S
from controlplane.events.models import Event
from controlplane.events.webhooks import WebhookDelivery, WebhookEndpoint
from controlplane.jobs.batches import Batch
from controlplane.jobs.files import File
from controlplane.jobs.models import Job
from controlplane.jobs.settlement import record_completion
from inference.engine import EngineConfig, LLMEngine, SamplingParams
from inference.node.state import Heartbeats, engine_state
from inference.protocol.heartbeat import NODE_KEY_PREFIX, RedisHeartbeat
from inference.protocol.messages import CompletionResult, Usage

MODEL = "SmolLM2-135M-Instruct"  # the `smollm2` fixture's catalog model, priced
TOOL_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(autouse=True)
def broker_left_clean():
    """Cancels and settlements enqueue work (aborts, fan-outs): dropped, no worker runs here."""
    yield
    dramatiq.get_broker().flush_all()


def signed_in(org, role: str = "developer") -> Client:
    """A client signed in as a new member of `org` with `role`."""
    user = get_user_model().objects.create(username=f"{role}-{uuid.uuid4().hex[:8]}")
    Membership.objects.create(org=org, user=user, role=role)
    client = Client()
    client.force_login(user)
    return client


def submitted(org, key=None, **fields) -> Job:
    """A queued async job with its `job.queued` event, as admission writes it."""
    fields = {
        "model": MODEL,
        "mode": Job.ASYNC,
        "request": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        "prompt_token_ids": [1, 2, 3],
        **fields,
    }
    [job] = Job.objects.submit_all([Job(org=org, api_key=key, **fields)])
    return job


def run_on(job: Job, node: str) -> None:
    Job.objects.record_started({"request_id": job.request_id, "node": node, "attempt": 1})


def text_of(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", fragment))


def section(page: str, element_id: str) -> str:
    """The text of the element with `element_id`, up to the first closing tag (a leaf)."""
    match = re.search(rf'id="{element_id}"[^>]*>(.*?)</', page, re.S)
    assert match is not None, f"no #{element_id} in the page"
    return text_of(match.group(1))


def part(page: str, element_id: str) -> str:
    """The text from the element with `element_id` to the page's next heading (a section)."""
    match = re.search(rf'id="{element_id}"[^>]*>(.*?)(<h2|$)', page, re.S)
    assert match is not None, f"no #{element_id} in the page"
    return text_of(match.group(1))


def rows(page: str, table_id: str) -> list[list[str]]:
    body = re.search(rf'<table id="{table_id}">.*?<tbody>(.*?)</tbody>', page, re.S).group(1)
    return [
        [" ".join(text_of(cell).split()) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)
    ]


# The job page.


def test_the_job_page_shows_request_response_timeline_charge_and_deliveries(org_a, key_a, smollm2):
    endpoint = WebhookEndpoint.objects.create(org=org_a, url="https://93.184.215.14/hooks")
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You forecast."},
            {"role": "user", "content": "Weather in Paris?"},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        "temperature": 0.25,
        "logprobs": True,
    }
    job = submitted(
        org_a,
        ApiKey.objects.get(org=org_a),
        request=body,
        sampling={"temperature": 0.25, "max_tokens": 16},
        prompt_token_ids=list(range(40)),
    )
    run_on(job, "node-7")
    record_completion(
        CompletionResult(
            request_id=job.request_id,
            job_id=job.id,
            node="node-7",
            prefill_node="prefill-2",
            text=TOOL_CALL,
            token_ids=[5, 6],
            finish_reason="stop",
            usage=Usage(40, 32, 2),
            timings={"ttft_s": 0.0125, "tpot_s": 0.0031, "e2e_s": 0.05},
            logprobs=[{"token": "<tool_call>", "logprob": -0.25, "top_logprobs": []}],
        )
    )
    events = list(Event.objects.filter(org=org_a).order_by("sequence"))
    for event in events:
        WebhookDelivery.objects.fan_out(event.pk)
    record = UsageRecord.objects.get(request_id=job.request_id)

    response = signed_in(org_a).get(reverse("console:job", args=[job.id]))
    assert response.status_code == 200
    page = response.content.decode()

    assert re.search(r'id="job-status" class="badge completed" data-status="completed"', page)
    assert 'id="cancel-form"' not in page  # settled: nothing to cancel
    request = part(page, "request")
    assert "You forecast." in request and "Weather in Paris?" in request
    assert json.loads(section(page, "request-parameters"))["temperature"] == 0.25
    assert json.loads(section(page, "sampling")) == {"temperature": 0.25, "max_tokens": 16}
    answer = part(page, "response")
    assert "get_weather" in answer and '"city": "Paris"' in answer
    assert "tool_calls" in answer and "-0.2500" in answer  # finish reason, logprob
    assert section(page, "job-node").strip() == "node-7" and "prefill-2" in page
    assert section(page, "job-attempts").strip() == "1"
    assert (
        section(page, "ttft").strip() == "0.013 s" and section(page, "tpot").strip() == "0.0031 s"
    )
    assert [section(page, f"{n}-tokens").strip() for n in ("prompt", "cached", "completion")] == [
        "40",
        "32",
        "2",
    ]
    # Charged what the ledger says, at the price the ledger names.
    assert section(page, "cost-total").strip() == decimal_string(record.total_cost)
    assert rows(page, "charge")[0] == [
        "Input",
        decimal_string(record.input_cost),
        decimal_string(record.price.input_per_mtok),
    ]
    assert [row[0] for row in rows(page, "timeline")] == [
        "job.queued",
        "job.running",
        "job.completed",
    ]
    deliveries = rows(page, "deliveries")
    assert [(row[0], row[1], row[2], row[3]) for row in deliveries] == [
        (event.type, endpoint.url, "1", "pending") for event in events
    ]


def test_a_queued_job_is_cancelled_from_its_page_once(org_a, smollm2):
    job = submitted(org_a)
    client = signed_in(org_a)
    page = client.get(reverse("console:job", args=[job.id])).content.decode()
    assert 'id="cancel-form"' in page and 'data-status="queued"' in page

    response = client.post(reverse("console:cancel-job", args=[job.id]))
    assert response.status_code == 302
    assert response["Location"] == reverse("console:job", args=[job.id])
    job.refresh_from_db()
    assert job.status == Job.CANCELLED
    cancelled_at = job.finished_at
    page = client.get(response["Location"]).content.decode()
    assert 'data-status="cancelled"' in page and 'id="cancel-form"' not in page
    assert [row[0] for row in rows(page, "timeline")] == ["job.queued", "job.cancelled"]

    # Again: the job is settled, nothing changes.
    assert client.post(reverse("console:cancel-job", args=[job.id])).status_code == 302
    job.refresh_from_db()
    assert (job.status, job.finished_at) == (Job.CANCELLED, cancelled_at)
    assert Event.objects.filter(org=org_a, type="job.cancelled").count() == 1
    assert client.get(reverse("console:cancel-job", args=[job.id])).status_code == 405


def test_cancelling_a_running_job_asks_its_node_once(org_a, smollm2):
    job = submitted(org_a)
    run_on(job, "node-3")
    client = signed_in(org_a)
    client.post(reverse("console:cancel-job", args=[job.id]))
    job.refresh_from_db()
    asked_at = job.cancel_requested_at
    assert job.status == Job.RUNNING and asked_at is not None
    page = client.get(reverse("console:job", args=[job.id])).content.decode()
    assert 'id="cancel-requested"' in page and 'id="cancel-form"' not in page

    client.post(reverse("console:cancel-job", args=[job.id]))
    job.refresh_from_db()
    assert (job.status, job.cancel_requested_at) == (Job.RUNNING, asked_at)


def test_cancel_needs_the_csrf_token(org_a, smollm2):
    job = submitted(org_a)
    user = get_user_model().objects.create(username="csrf-dev")
    Membership.objects.create(org=org_a, user=user, role="developer")
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    assert client.post(reverse("console:cancel-job", args=[job.id])).status_code == 403
    job.refresh_from_db()
    assert job.status == Job.QUEUED


def test_the_jobs_table_links_each_job_to_its_page(org_a, smollm2):
    job = submitted(org_a)
    page = signed_in(org_a).get(reverse("console:jobs")).content.decode()
    assert f'<a href="{reverse("console:job", args=[job.id])}"><code>{job.id}</code></a>' in page


# Batches.


def batch_of(org, lines: int, invalid: int = 0) -> Batch:
    """An in-progress batch of `lines` valid lines (one queued job each, custom ids l0, l1, …)
    and `invalid` refused ones, with its input file."""
    content = "".join(
        json.dumps(
            {"custom_id": f"l{n}", "method": "POST", "url": "/v1/chat/completions", "body": {}}
        )
        + "\n"
        for n in range(lines + invalid)
    ).encode()
    upload = File.objects.upload(org, "requests.jsonl", File.BATCH, content)
    batch = Batch.objects.create(
        org=org,
        endpoint="/v1/chat/completions",
        model=MODEL,
        input_file_id=upload.id,
        completion_window="24h",
        status=Batch.IN_PROGRESS,
        total=lines + invalid,
        failed=invalid,
        invalid_lines=[
            {
                "line": lines + n + 1,
                "custom_id": f"l{lines + n}",
                "code": "invalid_value",
                "message": "bad",
                "param": "messages",
            }
            for n in range(invalid)
        ],
        in_progress_at=timezone.now(),
        expires_at=timezone.now() + timedelta(days=1),
    )
    for n in range(lines):
        submitted(org, mode=Job.BATCH, batch=batch, custom_id=f"l{n}")
    return batch


def settle(job: Job) -> None:
    run_on(job, "node-1")
    record_completion(
        CompletionResult(
            request_id=job.request_id,
            job_id=job.id,
            node="node-1",
            text=f"answer to {job.custom_id}",
            token_ids=[1],
            finish_reason="stop",
            usage=Usage(3, 0, 1),
        )
    )


def test_the_batch_pages_show_progress_and_serve_the_files(
    org_a, smollm2, django_capture_on_commit_callbacks
):
    batch = batch_of(org_a, lines=3, invalid=1)
    client = signed_in(org_a)
    jobs = list(batch.jobs.order_by("custom_id"))
    # Settlements count the batch's lines; the commit of the last one finalizes it.
    with django_capture_on_commit_callbacks(execute=True):
        settle(jobs[0])

    listed = client.get(reverse("console:batches")).content.decode()
    [row] = rows(listed, "batches")
    assert row[0] == batch.id and row[1] == "in_progress"
    assert row[4:8] == ["50 %", "1", "1", "4"]  # 2 of 4 settled: one completed, one invalid
    page = client.get(reverse("console:batch", args=[batch.id])).content.decode()
    assert 'style="width: 50%"' in page and section(page, "progress-text").strip().startswith(
        "2 of 4"
    )
    assert 'id="live-status"' in page  # in progress: the page follows it
    assert "bad" in part(page, "invalid-lines")
    assert [r[:3] for r in rows(page, "batch-jobs")] == [
        ["l0", jobs[0].id, "completed"],
        ["l1", jobs[1].id, "queued"],
        ["l2", jobs[2].id, "queued"],
    ]

    with django_capture_on_commit_callbacks(execute=True):
        settle(jobs[1])
        settle(jobs[2])
    batch.refresh_from_db()
    assert batch.status == Batch.COMPLETED and batch.output_file_id and batch.error_file_id
    page = client.get(reverse("console:batch", args=[batch.id])).content.decode()
    assert 'data-status="completed"' in page and 'style="width: 100%"' in page
    assert 'id="live-status"' not in page
    assert [section(page, f"count-{n}").strip() for n in ("total", "completed", "failed")] == [
        "4",
        "3",
        "1",
    ]
    listed = client.get(reverse("console:batches")).content.decode()
    assert rows(listed, "batches")[0][4] == "100 %"

    # Each of its files downloads, as stored.
    for kind, file_id in [
        ("input", batch.input_file_id),
        ("output", batch.output_file_id),
        ("error", batch.error_file_id),
    ]:
        link = link_of(file_id)
        assert f'href="{link}"' in re.search(rf'<tr id="file-{kind}">.*?</tr>', page, re.S)[0]
        download = client.get(link)
        assert download.status_code == 200
        stored = File.objects.get(id=file_id)
        assert download.content == bytes(stored.content)
        assert download["Content-Disposition"] == f'attachment; filename="{stored.filename}"'
    output = [
        json.loads(line) for line in client.get(link_of(batch.output_file_id)).content.splitlines()
    ]
    assert [
        (o["custom_id"], o["response"]["body"]["choices"][0]["message"]["content"]) for o in output
    ] == [
        ("l0", "answer to l0"),
        ("l1", "answer to l1"),
        ("l2", "answer to l2"),
    ]


def link_of(file_id: str) -> str:
    return reverse("console:file-content", args=[file_id])


# Another org, and the billing viewer.


def test_another_orgs_job_batch_and_file_are_not_found(org_a, org_b, smollm2):
    job = submitted(org_b)
    batch = batch_of(org_b, lines=1)
    client = signed_in(org_a)
    for path in (
        reverse("console:job", args=[job.id]),
        reverse("console:batch", args=[batch.id]),
        link_of(batch.input_file_id),
    ):
        assert client.get(path).status_code == 404, path
    assert client.post(reverse("console:cancel-job", args=[job.id])).status_code == 404
    job.refresh_from_db()
    assert job.status == Job.QUEUED and job.cancel_requested_at is None
    assert batch.id not in client.get(reverse("console:batches")).content.decode()


def test_a_billing_viewer_sees_no_fleet_job_or_batch(org_a, smollm2):
    job = submitted(org_a)
    batch = batch_of(org_a, lines=1)
    viewer = signed_in(org_a, "billing")
    for path in (
        reverse("console:fleet"),
        reverse("console:fleet-json"),
        reverse("console:job", args=[job.id]),
        reverse("console:batches"),
        reverse("console:batch", args=[batch.id]),
        link_of(batch.input_file_id),
    ):
        response = viewer.get(path)
        assert response.status_code == 403 and b'id="forbidden"' in response.content, path
    assert viewer.post(reverse("console:cancel-job", args=[job.id])).status_code == 403
    job.refresh_from_db()
    assert job.status == Job.QUEUED
    nav = viewer.get(reverse("console:members")).content.decode()
    for name in ("fleet", "batches"):
        assert f'href="{reverse(f"console:{name}")}"' not in nav


# The fleet.


@pytest.fixture
def heartbeats(settings):
    """The registry reading the real Redis (no cache); the node keys written are deleted."""
    settings.REDIS_URL = django_settings.DRAMATIQ_BROKER["OPTIONS"]["url"]
    settings.NODE_REGISTRY_TTL_S = 0
    registry.use_memory_heartbeat(None)
    client = redis.Redis.from_url(settings.REDIS_URL)
    written: list[str] = []

    def sink(node_id: str) -> Heartbeats:
        written.append(node_id)
        return Heartbeats(RedisHeartbeat(client), node_id, interval_s=2.0)

    yield sink
    for node_id in written:
        client.delete(NODE_KEY_PREFIX + node_id)


def test_the_fleet_shows_a_node_from_its_heartbeat_and_marks_a_late_one_stale(
    org_a, heartbeats, tiny_llama_dir
):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            max_model_len=256,
            max_num_seqs=4,
            kv_cache_memory_bytes=1 << 20,
        )
    )
    # One finished request leaves its prompt's full blocks in the prefix cache; one runs.
    engine.add_request("done", list(range(5, 45)), SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("going", list(range(50, 90)), SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    stats = engine.stats()
    assert stats.num_running == 1 and stats.num_free_blocks < stats.num_blocks

    suffix = uuid.uuid4().hex[:8]
    live_id, late_id = f"fleet-live-{suffix}", f"fleet-late-{suffix}"
    live = heartbeats(live_id)
    live.beat(lambda: engine_state(live_id, "tiny", "decode", engine, free_slots=3))
    # A beat sent longer ago than a node's interval and a half, still inside its TTL.
    heartbeats(late_id).beat(
        lambda: {**engine_state(late_id, "tiny", "unified", engine, 4), "at": time.time() - 4.5}
    )
    assert STALE_AFTER_S < 4.5

    client = signed_in(org_a)
    fleet = {row["id"]: row for row in client.get(reverse("console:fleet-json")).json()["data"]}
    assert fleet[live_id] == {
        "id": live_id,
        "model": "tiny",
        "role": "decode",
        "blocks_total": stats.num_blocks,
        "blocks_used": stats.num_blocks - stats.num_free_blocks,
        "blocks_free": stats.num_free_blocks,
        "blocks_used_percent": round(
            (stats.num_blocks - stats.num_free_blocks) * 100 / stats.num_blocks
        ),
        "running": 1,
        "waiting": 0,
        "prefix_blocks": len(engine.cached_block_hashes()),
        "last_seen_s": fleet[live_id]["last_seen_s"],
        "state": "live",
    }
    assert fleet[live_id]["prefix_blocks"] >= 2  # the finished prompt's 40 tokens: 2 full blocks
    assert fleet[live_id]["last_seen_s"] < STALE_AFTER_S
    assert fleet[late_id]["state"] == "stale" and fleet[late_id]["last_seen_s"] >= 4.5

    page = client.get(reverse("console:fleet")).content.decode()
    assert f'<tr id="node-{live_id}" data-state="live">' in page
    assert f'<tr id="node-{late_id}" data-state="stale">' in page

    # A node that leaves (drains, stops) is gone at once.
    live.leave()
    assert live_id not in {
        row["id"] for row in client.get(reverse("console:fleet-json")).json()["data"]
    }

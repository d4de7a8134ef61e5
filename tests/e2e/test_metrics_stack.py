"""Metrics and logs from every process of the production stack (docs/observability.md). After a
known workload through the `openai` SDK (five completions, two of them streamed, and one refused),
the gateway's, the worker's and the node's `/metrics` agree with the jobs table and with what was
sent, the node's KV gauges with its heartbeat, and one request id is found in the JSON log lines
of the gateway, the node and the worker."""

from __future__ import annotations

import json
import os

import openai
import pytest

from controlplane.jobs.models import Job
from inference.protocol.heartbeat import NODE_KEY_PREFIX
from inference.protocol.messages import model_queue, node_queue
from tests.e2e.stack import free_port
from tests.e2e.user_path import wait_for
from tests.prometheus_scrape import scrape, value

pytestmark = pytest.mark.django_db(transaction=True)

SYSTEM = "Paged attention stores keys and values in fixed-size blocks. " * 2
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


def run_workload(client: openai.OpenAI, model: str) -> str:
    """Two chats (the second served from the first's cached prefix), a streamed chat, a text
    completion, a streamed one, and a chat refused with a 400; the streamed chat's request id."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Begin."}]
    asked = {"model": model, "max_tokens": 4, "temperature": 0}
    for _ in range(2):
        client.chat.completions.create(messages=messages, **asked)
    streamed = client.chat.completions.with_raw_response.create(
        messages=messages, stream=True, **asked
    )
    assert list(streamed.parse())
    client.completions.create(prompt=SYSTEM, **asked)
    assert list(client.completions.create(prompt=SYSTEM, stream=True, **asked))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(messages=messages, model=model, max_tokens=0)
    return streamed.headers["x-request-id"]


def gateway_requests(url: str) -> dict[tuple[str, str, str], float]:
    return {
        (labels["endpoint"], labels["model"], labels["status"]): count
        for (name, pairs), count in scrape(url).items()
        if name == "hearth_gateway_requests_total"
        for labels in [dict(pairs)]
    }


def json_lines(log: str) -> list[dict]:
    """The JSON lines of a process's log (the Dramatiq supervisor writes a few in text)."""
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def test_every_process_counts_the_workload_that_the_jobs_table_records(stack, tiny_model, acme_key):
    model, node, node_port = tiny_model.id, f"metrics-{os.getpid()}", free_port()
    node_url = f"http://127.0.0.1:{node_port}/metrics"
    stack.start_node(model, node, "--metrics-port", str(node_port))
    stack.wait_ready(model, nodes=1, api_key=acme_key)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=acme_key, max_retries=0)
    try:
        followed = run_workload(client, model)
        completed = Job.objects.filter(model=model, status=Job.COMPLETED)
        wait_for(lambda: completed.count() == 5, what="five completed jobs")
        jobs = list(completed)
        assert Job.objects.filter(model=model).count() == 5  # the 400 made none

        # The gateway: what was sent, by endpoint and status (flushed to Redis every second).
        sent = {(CHAT, model, "200"): 3, (TEXT, model, "200"): 2, (CHAT, "", "400"): 1}
        wait_for(lambda: gateway_requests(f"{stack.url}/metrics") == sent, what="the gateway")
        gateway = scrape(f"{stack.url}/metrics")
        duration = "hearth_gateway_request_duration_seconds_count"
        for endpoint, mode, count in ((CHAT, "sync", 2), (CHAT, "stream", 1), (TEXT, "sync", 1)):
            assert value(gateway, duration, endpoint=endpoint, model=model, mode=mode) == count
        assert value(gateway, duration, endpoint=TEXT, model=model, mode="stream") == 1
        for endpoint in (CHAT, TEXT):
            ttft = value(
                gateway, "hearth_gateway_ttft_seconds_count", endpoint=endpoint, model=model
            )
            assert ttft == 1

        # The worker: one observation per completed job, the usage ledger's token sums.
        worker_url = f"http://127.0.0.1:{stack.worker_metrics_port}/metrics"
        labels = {"model": model, "mode": "sync"}
        wait_for(
            lambda: (
                value(scrape(worker_url), "hearth_jobs_settled_total", status="completed", **labels)
                == 5
            ),
            what="the worker's counts",
        )
        worker = scrape(worker_url)
        for field in ("ttft_s", "tpot_s", "e2e_s", "queue_wait_s"):
            timed = [getattr(job, field) for job in jobs if getattr(job, field) is not None]
            series = f"hearth_job_{field.removesuffix('_s')}_seconds"
            assert value(worker, f"{series}_count", **labels) == len(timed), field
            assert value(worker, f"{series}_sum", **labels) == pytest.approx(sum(timed)), field
        usage = {
            field: sum(job.result["usage"][field] for job in jobs)
            for field in ("prompt_tokens", "cached_tokens", "completion_tokens")
        }
        assert usage["cached_tokens"] > 0  # the second chat hit the first's prefix
        for field, total in usage.items():
            assert value(worker, f"hearth_job_{field}_total", **labels) == total, field
        for queue in ("default", model_queue(model), node_queue(model, node)):
            assert value(worker, "hearth_broker_queue_depth", queue=queue) == 0, queue

        # The node: its own steps and timings, its cache's counts, its heartbeat's KV figures.
        of_node = {"model": model, "node": node}

        def node_at_rest():
            """The node's samples once a heartbeat after the workload has set its gauges (it
            had counted every prompt, and ran nothing)."""
            scraped = scrape(node_url)
            counted = value(scraped, "hearth_node_prefix_cache_query_tokens_total", **of_node)
            running = value(scraped, "hearth_node_running_requests", **of_node)
            return scraped if (counted, running) == (usage["prompt_tokens"], 0) else None

        scraped = wait_for(node_at_rest, what="the node's gauges after the workload")
        steps = value(scraped, "hearth_node_step_seconds_count", **of_node)
        assert steps > 0
        assert value(scraped, "hearth_node_batch_size_count", **of_node) == steps
        assert value(scraped, "hearth_node_batch_size_sum", **of_node) >= steps
        # Each step computed the prompts' uncached tokens, then one token per sampled token
        # but each request's last.
        computed = usage["prompt_tokens"] - usage["cached_tokens"] + usage["completion_tokens"] - 5
        assert value(scraped, "hearth_node_batch_tokens_sum", **of_node) == computed
        assert value(scraped, "hearth_node_ttft_seconds_count", **of_node) == 5
        node_ttft = value(scraped, "hearth_node_ttft_seconds_sum", **of_node)
        assert node_ttft == pytest.approx(sum(job.ttft_s for job in jobs))
        hits = value(scraped, "hearth_node_prefix_cache_hit_tokens_total", **of_node)
        assert hits == usage["cached_tokens"]
        beat = json.loads(stack.redis().get(NODE_KEY_PREFIX + node))
        assert value(scraped, "hearth_node_kv_blocks_free", **of_node) == beat["free_blocks"]
        used = beat["num_blocks"] - beat["free_blocks"]
        assert value(scraped, "hearth_node_kv_blocks_used", **of_node) == used
        assert value(scraped, "hearth_node_waiting_requests", **of_node) == beat["waiting"] == 0
    except Exception:
        print(stack.outputs())
        raise

    # One request id through the three processes' JSON lines, with its job's id.
    job = Job.objects.get(request_id=followed)
    for process in ("gateway", f"node-{node}", "worker"):
        lines = [
            line for line in json_lines(stack.log(process)) if line.get("request_id") == followed
        ]
        assert lines, f"no line of {process} names {followed}:\n{stack.output(process)}"
        for line in lines:
            assert {"time", "level", "logger", "message"} <= set(line)
            assert line["job_id"] == job.id and line["org"] == "acme", line
    [node_line] = [
        line for line in json_lines(stack.log(f"node-{node}")) if line.get("request_id") == followed
    ]
    assert node_line["node"] == node and node_line["message"].startswith("finished")

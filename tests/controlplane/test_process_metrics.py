"""The pieces of docs/observability.md that one process shows: the log formatters, settlement's
counts (once per settled job, however often its result arrives), and embedded mode's one
`/metrics` showing the worker's and the nodes' series beside the gateway's. The production stack's
processes are checked against each other in tests/e2e/test_metrics_stack.py."""

from __future__ import annotations

import io
import json
import logging
import uuid

import pytest
from prometheus_client import generate_latest

from controlplane.embedded import EmbeddedHearth
from controlplane.jobs.job_metrics import WORKER_REGISTRY
from controlplane.jobs.models import Job
from controlplane.jobs.settlement import record_completion
from inference.protocol.logs import JsonFormatter, TextFormatter, log_context
from inference.protocol.messages import CompletionResult, Usage
from tests.controlplane.conftest import priced_model
from tests.prometheus_scrape import samples, value


def logged(formatter: logging.Formatter, emit) -> list[str]:
    """The lines `emit(logger)` writes through `formatter`."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger = logging.getLogger(f"tests.logs.{uuid.uuid4().hex}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    emit(logger)
    return stream.getvalue().splitlines()


def test_json_lines_carry_the_ids_of_the_request_being_handled():
    def emit(logger):
        logger.info("before")
        with log_context(request_id="req_1", job_id="job_1", org="acme", node=None):
            with log_context(node="node-a"):
                logger.warning("taken by %s", "node-a", extra={"status": 200})
            try:
                raise ValueError('bad "quote"\nline')
            except ValueError:
                logger.exception("failed")
        logger.info("after")

    lines = logged(JsonFormatter(), emit)
    assert len(lines) == 4  # one line each, the traceback's newlines escaped inside its line
    before, taken, failed, after = map(json.loads, lines)
    assert list(before) == ["time", "level", "logger", "message"]
    assert before["time"].endswith("Z") and before["level"] == "INFO"
    assert taken == {
        "time": taken["time"],
        "level": "WARNING",
        "logger": taken["logger"],
        "message": "taken by node-a",
        "request_id": "req_1",
        "job_id": "job_1",
        "org": "acme",
        "node": "node-a",
        "status": 200,
    }
    assert failed["request_id"] == "req_1" and "node" not in failed  # the inner block ended
    assert failed["exception"].startswith("Traceback") and 'bad "quote"' in failed["exception"]
    assert "request_id" not in after


def test_text_lines_append_the_ids():
    def emit(logger):
        with log_context(request_id="req_2", org="acme"):
            logger.info("settled")

    [line] = logged(TextFormatter(), emit)
    assert line.endswith(" settled request_id=req_2 org=acme") and " INFO tests.logs." in line


def settled_result(job: Job, error: str | None = None) -> CompletionResult:
    return CompletionResult(
        request_id=job.request_id,
        job_id=job.id,
        node="node-1",
        text="" if error else "answer",
        token_ids=[] if error else [1, 2, 3],
        finish_reason=None if error else "stop",
        usage=Usage(0, 0, 0) if error else Usage(12, 8, 3),
        error=error,
        timings={} if error else {"ttft_s": 0.2, "tpot_s": 0.05, "e2e_s": 0.3},
    )


def test_a_job_is_counted_once_when_it_settles(org_a, django_capture_on_commit_callbacks):
    model = f"counted-{uuid.uuid4().hex[:8]}"  # counts live in this process: a model of its own
    priced_model(model, model, 256)
    jobs = [
        Job.objects.create(org=org_a, model=model, request={}, prompt_token_ids=[1] * 12)
        for _ in range(2)
    ]
    with django_capture_on_commit_callbacks(execute=True):
        assert record_completion(settled_result(jobs[0]))
    with django_capture_on_commit_callbacks(execute=True):
        assert not record_completion(settled_result(jobs[0]))  # a redelivery settles nothing
    with django_capture_on_commit_callbacks(execute=True):
        assert record_completion(settled_result(jobs[1], error="the node failed"))

    scraped = samples(generate_latest(WORKER_REGISTRY).decode())
    labels = {"model": model, "mode": "sync"}
    assert value(scraped, "hearth_jobs_settled_total", status="completed", **labels) == 1
    assert value(scraped, "hearth_jobs_settled_total", status="failed", **labels) == 1
    for series, seconds in (("ttft", 0.2), ("tpot", 0.05), ("e2e", 0.3)):
        name = f"hearth_job_{series}_seconds"
        assert value(scraped, f"{name}_count", **labels) == 1
        assert value(scraped, f"{name}_sum", **labels) == pytest.approx(seconds)
    # The 0.2 s TTFT falls in the 0.25 s bucket, not in the 0.1 s one.
    ttft_bucket = "hearth_job_ttft_seconds_bucket"
    assert value(scraped, ttft_bucket, le="0.1", **labels) == 0
    assert value(scraped, ttft_bucket, le="0.25", **labels) == 1
    assert value(scraped, "hearth_job_queue_wait_seconds_count", **labels) == 1
    assert value(scraped, "hearth_job_prompt_tokens_total", **labels) == 12
    assert value(scraped, "hearth_job_cached_tokens_total", **labels) == 8
    assert value(scraped, "hearth_job_completion_tokens_total", **labels) == 3


def test_embedded_metrics_show_the_worker_and_the_nodes_beside_the_gateway(client, db):
    hearth = EmbeddedHearth("127.0.0.1", 0)
    hearth.node_metrics.node("tiny", "embedded-tiny")  # a node of this process
    hearth.expose_metrics()
    try:
        text = client.get("/metrics").content.decode()
    finally:
        hearth.hide_metrics()
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert {
        "hearth_route_requests_total",  # the registry's own
        "hearth_gateway_requests_total",
        "hearth_gateway_request_duration_seconds",
        "hearth_jobs_settled_total",
        "hearth_job_ttft_seconds",
        "hearth_broker_queue_depth",
        "hearth_node_step_seconds",
        "hearth_node_kv_blocks_free",
    } <= families
    assert "hearth_jobs_settled_total" not in {
        line.split()[2]
        for line in client.get("/metrics").content.decode().splitlines()
        if line.startswith("# TYPE")
    }

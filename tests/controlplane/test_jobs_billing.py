"""Jobs settle and bill exactly once, from a node's result, whatever the delivery count."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from datetime import timedelta
from decimal import Decimal

import dramatiq
import pytest
from django.conf import settings
from django.db.utils import DataError

from controlplane.billing.models import UsageRecord
from controlplane.billing.pricing import compute_costs, decimal_string
from controlplane.catalog.models import Price, ServedModel
from controlplane.events.models import Event
from controlplane.jobs.models import Job
from controlplane.jobs.settlement import record_completion, record_completions
from inference.protocol.messages import (
    CONTROLPLANE_QUEUE,
    GENERATE_ACTOR,
    CompletionResult,
    Usage,
    model_queue,
)


def make_job(org, model="SmolLM2-135M-Instruct", **fields) -> Job:
    return Job.objects.create(
        org=org,
        model=model,
        request={"model": model, "prompt": "hi"},
        prompt_token_ids=[3, 4, 5, 6],
        sampling={"temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
        **fields,
    )


def result_for(
    job: Job, prompt=1000, cached=600, completion=200, timings=None, **extra
) -> CompletionResult:
    return CompletionResult(
        request_id=job.request_id,
        job_id=job.id,
        node="node-1",
        text="hello",
        token_ids=[1, 2],
        finish_reason="stop",
        usage=Usage(prompt, cached, completion),
        timings={"ttft_s": 0.1} if timings is None else timings,
        **extra,
    )


def test_costs_are_exact_decimals():
    costs = compute_costs(1000, 600, 200, Decimal("0.60"), Decimal("0.10"), Decimal("3.00"))
    assert costs.input == Decimal("0.00024")
    assert costs.cached_input == Decimal("0.00006")
    assert costs.output == Decimal("0.0006")
    assert costs.total == Decimal("0.0009")
    assert costs.cache_savings == Decimal("0.0003")
    with pytest.raises(ValueError, match="inconsistent usage"):
        compute_costs(10, 11, 0, Decimal(1), Decimal(1), Decimal(1))


def test_a_result_delivered_twice_settles_and_bills_once(org_a, smollm2):
    job = make_job(org_a)
    assert record_completion(result_for(job))
    assert not record_completion(result_for(job, completion=999))
    job.refresh_from_db()
    assert job.status == Job.COMPLETED and job.node == "node-1"
    assert job.result["usage"]["completion_tokens"] == 200
    [record] = UsageRecord.objects.all()
    assert record.total_cost == Decimal("0.0009") and record.cache_savings == Decimal("0.0003")
    assert record.price == smollm2.current_price()
    assert job.result["cost"] == {
        "currency": "USD",
        "input": "0.00024",
        "cached_input": "0.00006",
        "output": "0.0006",
        "total": "0.0009",
        "cache_savings": "0.0003",
    }
    # queued → running → completed, one event each, the last carrying usage and cost.
    events = list(Event.objects.filter(data__id=job.id).order_by("sequence"))
    assert [e.type for e in events] == ["job.running", "job.completed"]
    assert events[-1].data["cost"]["total"] == "0.0009"
    assert events[-1].data["usage"]["prompt_tokens_details"]["cached_tokens"] == 600


def test_a_price_of_ten_or_more_reads_back_without_an_exponent():
    assert decimal_string(Decimal("10.000000")) == "10"
    assert decimal_string(Decimal("0.000600000000")) == "0.0006"
    assert decimal_string(Decimal("0E-12")) == "0"


def test_usage_keeps_the_price_it_was_charged_at(org_a, smollm2):
    first = make_job(org_a)
    record_completion(result_for(first))
    Price.objects.create(
        model=smollm2,
        input_per_mtok=Decimal("1.20"),
        cached_input_per_mtok=Decimal("0.20"),
        output_per_mtok=Decimal("6.00"),
    )
    second = make_job(org_a)
    record_completion(result_for(second))
    old, new = (UsageRecord.objects.get(request_id=j.request_id) for j in (first, second))
    assert old.total_cost == Decimal("0.0009") and new.total_cost == Decimal("0.0018")


def test_an_error_result_fails_the_job_and_bills_nothing(org_a, smollm2):
    job = make_job(org_a)
    assert record_completion(result_for(job, error="prompt too long"))
    job.refresh_from_db()
    assert job.status == Job.FAILED and job.error == "prompt too long"
    assert job.error_code == "node_error"  # the node sent no code of its own
    assert not UsageRecord.objects.exists()


@pytest.mark.parametrize("transactional", [False, True], ids=["one", "together"])
def test_settling_keeps_the_nodes_timings_and_the_queue_wait(org_a, smollm2, transactional):
    jobs = [make_job(org_a) for _ in range(2)]
    assert jobs[0].start("node-1")
    # Started 3 s after it was admitted (moving `created` back would predate its price).
    Job.objects.filter(pk=jobs[0].pk).update(started_at=jobs[0].created + timedelta(seconds=3))
    timings = {"queued_s": 0.01, "ttft_s": 0.25, "tpot_s": 0.02, "e2e_s": 1.5}
    results = [
        result_for(jobs[0], timings=timings),
        result_for(jobs[1], timings={"ttft_s": "soon"}, error="no", error_code="overloaded"),
    ]
    if transactional:
        assert record_completions(results) == [True, True]
    else:
        assert [record_completion(result) for result in results] == [True, True]
    for job in jobs:
        job.refresh_from_db()
    assert (jobs[0].ttft_s, jobs[0].tpot_s, jobs[0].e2e_s) == (0.25, 0.02, 1.5)
    assert jobs[0].queue_wait_s == pytest.approx(
        (jobs[0].started_at - jobs[0].created).total_seconds()
    )
    assert jobs[0].queue_wait_s >= 3 and jobs[0].error_code == ""
    # A timing that is not a number is left out; the node's error code is kept.
    assert (jobs[1].ttft_s, jobs[1].tpot_s, jobs[1].error_code) == (None, None, "overloaded")


def test_start_claims_a_queued_job_once_and_counts_every_start(org_a, smollm2):
    job = make_job(org_a)
    assert job.start("node-1")
    # A second start is the message redelivered after node-1 died: one more attempt, no new
    # claim and no second job.running event.
    assert not Job.objects.get(pk=job.pk).start("node-2")
    job.refresh_from_db()
    assert job.status == Job.RUNNING and job.attempts == 2 and job.node == "node-2"
    assert Event.objects.filter(data__id=job.id, type="job.running").count() == 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_deliveries_write_one_usage_row(org_a, smollm2):
    job = make_job(org_a)
    payload = result_for(job)
    barrier = threading.Barrier(4)
    outcomes = []

    def deliver():
        from django.db import connection

        barrier.wait()
        outcomes.append(record_completion(payload))
        connection.close()

    threads = [threading.Thread(target=deliver) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == [False, False, False, True]
    assert UsageRecord.objects.count() == 1


def test_results_reported_together_settle_together_each_once(org_a, smollm2):
    jobs = [make_job(org_a) for _ in range(3)]
    payloads = [result_for(job, completion=10 * (i + 1)) for i, job in enumerate(jobs)]
    assert record_completions(payloads) == [True, True, True]
    # The message again (a redelivery), and a result twice in one list: nothing more.
    assert record_completions([*payloads, payloads[0]]) == [False] * 4
    for job, payload in zip(jobs, payloads, strict=True):
        job.refresh_from_db()
        assert job.status == Job.COMPLETED
        assert job.result["usage"] == asdict(payload.usage)
        record = UsageRecord.objects.get(request_id=job.request_id)
        assert record.completion_tokens == payload.usage.completion_tokens
        # No start notice came before the result: the job passes through running.
        events = Event.objects.filter(data__id=job.id).order_by("sequence")
        assert [e.type for e in events] == ["job.running", "job.completed"]
    assert UsageRecord.objects.count() == 3


@pytest.mark.django_db(transaction=True)
def test_a_result_that_cannot_be_recorded_holds_up_none_of_the_others(org_a, smollm2):
    first, second = make_job(org_a), make_job(org_a)
    # PostgreSQL's jsonb refuses U+0000 (a node stores text through storable_text; this one
    # did not): the result cannot be written.
    broken = replace(result_for(second), text="a\x00b")
    with pytest.raises(DataError):  # raised after the others settled: Dramatiq retries it
        record_completions([result_for(first), broken])
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.status, second.status) == (Job.COMPLETED, Job.QUEUED)
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == [first.request_id]
    # The retry of the whole message, with the result mended, settles only what is left.
    assert record_completions([result_for(first), result_for(second)]) == [
        False,
        True,
    ]
    assert UsageRecord.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_settling_overlapping_results_concurrently_bills_each_job_once(org_a, smollm2):
    """Four deliveries of overlapping lists at once (redeliveries racing): the row locks, taken
    in request id order, serialise them without a deadlock."""
    jobs = [make_job(org_a) for _ in range(6)]
    payloads = [result_for(job) for job in jobs]
    lists = [payloads, payloads[::-1], payloads[1:4], payloads[2:][::-1]]
    barrier = threading.Barrier(len(lists))
    outcomes: list[list[bool]] = []

    def deliver(results):
        from django.db import connection

        barrier.wait()
        outcomes.append(record_completions(results))
        connection.close()

    threads = [threading.Thread(target=deliver, args=(results,)) for results in lists]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(sum(settled) for settled in outcomes) == len(jobs)
    assert UsageRecord.objects.count() == len(jobs)
    assert Event.objects.filter(type="job.completed").count() == len(jobs)


@pytest.mark.django_db(transaction=True)
def test_a_real_node_serves_a_job_and_the_worker_bills_it(org_a, tiny_llama_dir):
    """The whole path below the gateway: broker → node process → record_completion → worker."""
    model = ServedModel.objects.create(id="tiny", source=str(tiny_llama_dir), context_length=256)
    Price.objects.create(
        model=model,
        input_per_mtok=Decimal("0.60"),
        cached_input_per_mtok=Decimal("0.10"),
        output_per_mtok=Decimal("3.00"),
    )
    broker = dramatiq.get_broker()
    # The node runs as `manage.py runnode`, reading the model from the catalog in the test
    # database, with the test run's broker namespace.
    database = settings.DATABASES["default"]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "DATABASE_URL": f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}"
        f"/{database['NAME']}",
        "REDIS_URL": settings.DRAMATIQ_BROKER["OPTIONS"]["url"],
        "HEARTH_BROKER_NAMESPACE": settings.TEST_BROKER_NAMESPACE,
    }
    node = subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "runnode",
            "--model",
            "tiny",
            "--node-id",
            "node-e2e",
            "--dtype",
            "float32",
            "--kv-cache-mb",
            "16",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    import controlplane.jobs.tasks  # noqa: F401  (registers record_completion, as rundramatiq does)

    # The control plane's worker consumes only its own queue: generation queues are the nodes'.
    worker = dramatiq.Worker(
        broker, queues={CONTROLPLANE_QUEUE}, worker_threads=1, worker_timeout=100
    )
    worker.start()
    try:
        job = make_job(org_a, model="tiny")
        broker.enqueue(
            dramatiq.Message(
                queue_name=model_queue("tiny"),
                actor_name=GENERATE_ACTOR,
                args=(job.generation_message(),),
                kwargs={},
                options={},
            )
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            job.refresh_from_db()
            if job.status in Job.TERMINAL:
                break
            time.sleep(0.1)
    finally:
        worker.stop()
        node.terminate()
        output, _ = node.communicate(timeout=60)
        broker.flush_all()
    assert job.status == Job.COMPLETED, (job.status, job.error, output[-2000:])
    assert job.node == "node-e2e"
    [record] = UsageRecord.objects.filter(request_id=job.request_id)
    assert (record.prompt_tokens, record.completion_tokens) == (4, 8)
    expected = compute_costs(4, 0, 8, Decimal("0.60"), Decimal("0.10"), Decimal("3.00"))
    assert record.total_cost == expected.total

"""Faults in production mode, each ending with every job settled, exactly one usage row per
completed request and exactly one event per state change.

(a) A node is SIGKILLed while it generates; another node starts. The Redis broker requeues the
dead node's un-acked messages once its heartbeat is older than HEARTH_BROKER_HEARTBEAT_TIMEOUT_MS
(3 s here), the new node runs them, and the control plane counts the second attempt.

(b) The control plane's worker is SIGKILLed (with its worker process) while it records
completions; another starts. Messages it held are requeued the same way; a completion it was
recording rolls back with its connection and is recorded again, once.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request

import pytest

from controlplane.billing.models import UsageRecord
from controlplane.events.models import Event
from controlplane.jobs.models import Job
from tests.e2e.user_path import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

# Enough work that node-a is still generating when the first start notice reaches the database.
JOBS = 48


def submit_jobs(url: str, key: str, model: str, count: int) -> list[str]:
    ids = []
    for index in range(count):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"fault test {index}"}],
            "max_tokens": 200,
            "temperature": 0,
            "queue": True,
        }
        request = urllib.request.Request(
            f"{url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 202
            ids.append(json.loads(response.read())["id"])
    return ids


def wait_until_completed(job_ids: list[str]) -> None:
    wait_for(
        lambda: Job.objects.filter(id__in=job_ids, status=Job.COMPLETED).count() == len(job_ids),
        timeout_s=120,
        what="every job completed",
    )


def assert_settled_once(job_ids: list[str]) -> list[Job]:
    """Every job completed, one usage row each, and queued, running, completed once each."""
    time.sleep(0.5)  # a duplicate row or event would show up now
    jobs = list(Job.objects.filter(id__in=job_ids))
    assert len(jobs) == len(job_ids) and all(job.status == Job.COMPLETED for job in jobs)
    requests = [job.request_id for job in jobs]
    assert UsageRecord.objects.filter(request_id__in=requests).count() == len(jobs)
    for job in jobs:
        events = Event.objects.filter(data__id=job.id).order_by("sequence")
        types = list(events.values_list("type", flat=True))
        assert types == ["job.queued", "job.running", "job.completed"], (job.id, types)
    return jobs


def test_a_node_killed_mid_generation_loses_nothing(stack, tiny_model, acme_key):
    stack.env["HEARTH_BROKER_HEARTBEAT_TIMEOUT_MS"] = "3000"
    stack.start_node(tiny_model.id, "node-a", threads=1)
    stack.wait_ready(tiny_model.id, nodes=1, api_key=acme_key)
    job_ids = submit_jobs(stack.url, acme_key, tiny_model.id, JOBS)
    try:
        wait_for(
            lambda: Job.objects.filter(id__in=job_ids, status=Job.RUNNING).exists(),
            what="a job running on node-a",
        )
        stack.processes["node-node-a"].send_signal(signal.SIGKILL)
        stack.processes["node-node-a"].wait(timeout=10)
        stack.start_node(tiny_model.id, "node-b", threads=1)
        wait_until_completed(job_ids)
    except Exception:
        print(stack.outputs())
        raise

    jobs = assert_settled_once(job_ids)
    # The requests node-a was generating when it died ran again on node-b: two starts counted.
    rerun = [job for job in jobs if job.attempts == 2]
    assert rerun and all(job.node == "node-b" for job in rerun)
    assert all(job.attempts in (1, 2) for job in jobs)


def test_a_worker_killed_while_it_records_completions_loses_nothing(stack, tiny_model, acme_key):
    stack.start_node(tiny_model.id, "node-a", threads=1)
    stack.wait_ready(tiny_model.id, nodes=1, api_key=acme_key)
    job_ids = submit_jobs(stack.url, acme_key, tiny_model.id, JOBS)
    worker = stack.processes["worker"]
    try:
        wait_for(
            lambda: Job.objects.filter(id__in=job_ids, status=Job.COMPLETED).exists(),
            what="a first completion recorded",
        )
        # rundramatiq's master and the worker process it forked, as an OOM kill would take them.
        subprocess.run(["pkill", "-KILL", "-P", str(worker.pid)], check=False)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        left = Job.objects.filter(id__in=job_ids).exclude(status=Job.COMPLETED).count()
        stack.env["HEARTH_BROKER_HEARTBEAT_TIMEOUT_MS"] = "3000"
        stack.start_worker()
        wait_until_completed(job_ids)
    except Exception:
        print(stack.outputs())
        raise
    assert left, "the worker had recorded everything before it was killed"
    assert_settled_once(job_ids)

"""Draining a node (docs/deploy.md, "Draining a node"): SIGTERM to a real node process in the
production stack while it generates. It leaves the registry at once, takes nothing more from the
broker, finishes the requests it runs, reports them (billed once, each on its first and only
attempt) and exits with 0; what it never took waits in the broker for the next node."""

from __future__ import annotations

import os
import re
import signal

import pytest

from controlplane.billing.models import UsageRecord
from controlplane.jobs.models import Job
from inference.protocol.heartbeat import NODE_KEY_PREFIX
from inference.protocol.messages import model_queue, node_queue
from tests.e2e.test_faults import (
    JOBS,
    assert_settled_once,
    start_notice_sent,
    submit_jobs,
    wait_until_completed,
)
from tests.e2e.user_path import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_node_drained_with_sigterm_finishes_what_it_runs_and_takes_nothing_more(
    stack, tiny_model, acme_key
):
    # Node ids are Redis keys shared by every test run on the machine: this one is the run's own.
    drained, successor = f"drained-{os.getpid()}", f"successor-{os.getpid()}"
    model = tiny_model.id
    # 8 at a time, so the node is at work when the signal comes and most jobs still wait.
    stack.start_node(model, drained, "--max-num-seqs", "8", threads=1)
    stack.wait_ready(model, nodes=1, api_key=acme_key)
    job_ids = submit_jobs(stack.url, acme_key, model, JOBS)
    node = stack.processes[f"node-{drained}"]
    client = stack.redis()
    queues = [stack.broker_key(model_queue(model)), stack.broker_key(node_queue(model, drained))]
    try:
        wait_for(lambda: start_notice_sent(stack), what="the node starting a request")
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=120) == 0, stack.output(f"node-{drained}")
        log = stack.output(f"node-{drained}")
        # Gone from the registry as it exits, not when its state's TTL runs out.
        assert client.get(NODE_KEY_PREFIX + drained) is None
        # It was generating when the signal came, and drained.
        running = int(re.search(r"draining: finishing (\d+) running request", log).group(1))
        assert running >= 1 and "drained" in log, log
        # What it did not take is still in the broker.
        waiting = sum(client.llen(queue) for queue in queues)
        taken = JOBS - waiting
        assert waiting > 0 and taken >= running, (waiting, running)
        # Everything it took is settled: completed by it, on the first attempt, billed once.
        completed = Job.objects.filter(id__in=job_ids, status=Job.COMPLETED)
        wait_for(lambda: completed.count() == taken, what="the drained node's jobs settled")
        assert not Job.objects.filter(id__in=job_ids, status=Job.RUNNING).exists()
        for job in completed:
            assert (job.node, job.attempts) == (drained, 1), (job.id, job.node, job.attempts)
            assert job.result["finish_reason"] != "abort"
            [record] = UsageRecord.objects.filter(request_id=job.request_id)
            assert record.completion_tokens == job.result["usage"]["completion_tokens"] > 0

        stack.start_node(model, successor, threads=1)
        wait_until_completed(job_ids)
    except Exception:
        print(stack.outputs())
        raise
    jobs = assert_settled_once(stack, job_ids)
    assert {job.node for job in jobs} == {drained, successor}
    assert all(job.attempts == 1 for job in jobs)

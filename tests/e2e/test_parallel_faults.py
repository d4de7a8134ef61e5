"""A tensor-parallel node (two ranks, one node to the control plane) in production mode: one of
its rank processes is SIGKILLed while the group generates. The group goes down (rank 0 fails its
step and the node exits non-zero), the broker redelivers what it ran once its heartbeat is old,
another node finishes every job, and each completed request has exactly one usage row and one
event per state change (tests/e2e/test_faults.py's checks)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.test_faults import (
    assert_settled_once,
    finish_on_node_b,
    start_jobs,
    start_notice_sent,
)
from tests.e2e.user_path import wait_for
from tests.inference.test_tensor_parallel_engine import gone
from tests.inference.test_tensor_parallel_node import followers_of

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_rank_killed_mid_step_takes_its_group_down_and_loses_nothing(
    stack, tiny_model, acme_key, receiver
):
    stack.env["HEARTH_BROKER_HEARTBEAT_TIMEOUT_MS"] = "3000"
    _, job_ids = start_jobs(
        stack,
        tiny_model.id,
        acme_key,
        receiver,
        *("--max-num-seqs", "8", "--tensor-parallel", "2", "--dtype", "float32"),
        count=24,
    )
    node = stack.processes["node-node-a"]
    try:
        wait_for(lambda: start_notice_sent(stack), what="node-a starting a request")
        ranks = followers_of(node.pid)
        assert len(ranks) == 1, ranks  # rank 1 of a world of 2
        os.kill(ranks[0], signal.SIGKILL)
        # The group is down: the node exits non-zero on its own, promptly.
        assert node.wait(timeout=60) != 0
        assert all(gone(rank) for rank in ranks)
        finish_on_node_b(stack, tiny_model.id, job_ids)
    except Exception:
        print(stack.outputs())
        raise
    jobs = assert_settled_once(stack, job_ids)
    # What node-a's group ran when it went down ran again on node-b. (Its second run is counted
    # unless the worker took node-b's result before node-b's start notice: test_faults.py.)
    assert any(job.node == "node-b" for job in jobs)
    assert all(job.attempts in (1, 2) for job in jobs)

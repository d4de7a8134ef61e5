"""A tensor-parallel node (two ranks, one node to the control plane) in production mode: one of
its rank processes is SIGKILLed while the group generates. The group goes down (rank 0 fails its
step and the node exits non-zero), the broker redelivers what it ran once its heartbeat is old,
another node finishes every job, and each completed request has exactly one usage row and one
event per state change (tests/e2e/test_faults.py's checks)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from controlplane.jobs.models import Job
from tests.e2e.test_faults import (
    assert_settled_once,
    start_jobs,
    start_notice_sent,
    wait_until_completed,
)
from tests.e2e.user_path import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def followers_of(pid: int) -> list[int]:
    """The rank processes a node started: its children that multiprocessing spawned (not its
    resource tracker)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid and "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            found.append(int(proc.name))
    return found


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
        assert not followers_of(node.pid)
        wait_for(
            lambda: Job.objects.filter(id__in=job_ids, node="node-a").exists(),
            timeout_s=120,
            what="the worker recording node-a's start",
        )
        stack.start_node(tiny_model.id, "node-b", threads=1)
        wait_until_completed(job_ids)
    except Exception:
        print(stack.outputs())
        raise
    jobs = assert_settled_once(stack, job_ids)
    # What node-a's group ran when it went down ran again on node-b. (Its second run is counted
    # unless the worker took node-b's result before node-b's start notice: test_faults.py.)
    assert any(job.node == "node-b" for job in jobs)
    assert all(job.attempts in (1, 2) for job in jobs)

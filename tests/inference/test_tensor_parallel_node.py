"""A node served by a group of two ranks (`python -m inference.node --tensor-parallel 2`, a real
process against the real Redis broker): when its follower rank is killed mid-generation the node
exits non-zero, the broker hands its un-acked requests to another node, and each request is
reported completed exactly once; a group node stopped with SIGTERM stops its followers and exits
with 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from inference.node.__main__ import parse_args
from inference.protocol.keyed_messages import KeyedRedisBroker
from inference.protocol.messages import (
    CONTROLPLANE_QUEUE,
    RECORD_COMPLETION_ACTOR,
    RECORD_STARTED_ACTOR,
    results_of,
)
from tests.inference.test_node import MODEL, REDIS_URL, enqueue, request
from tests.inference.test_tensor_parallel_engine import gone

REPOSITORY = Path(__file__).resolve().parents[2]
# The broker requeues a dead consumer's messages once its heartbeat is this old.
HEARTBEAT_MS = 2000


@pytest.fixture
def broker():
    broker = KeyedRedisBroker(url=REDIS_URL, namespace=f"hearth-test-{uuid.uuid4().hex[:8]}")
    yield broker
    broker.flush_all()
    broker.close()


def start_node(model_dir, broker, node_id: str, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "inference.node", "--model", MODEL]
    command += ["--source", str(model_dir), "--node-id", node_id, "--redis-url", REDIS_URL]
    command += ["--broker-namespace", broker.namespace, "--dtype", "float32"]
    command += ["--kv-cache-mb", "16", "--broker-heartbeat-ms", str(HEARTBEAT_MS), *extra]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPOSITORY
    )


def followers_of(pid: int) -> list[int]:
    """The rank processes a node started (its spawned children; not multiprocessing's
    resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [
        int(child)
        for child in children
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()
    ]


def test_a_group_node_whose_follower_dies_exits_and_its_requests_run_once_elsewhere(
    tiny_llama_dir, broker
):
    ids = [f"tp-{index}" for index in range(2)]
    for request_id in ids:
        body = request(request_id, [3, 4, 5, 6])
        body["sampling"]["max_tokens"] = 600  # a second or more: the kill lands mid-way
        enqueue(broker, body)
    node_a = start_node(tiny_llama_dir, broker, "node-a", "--tensor-parallel", "2")
    node_b = None
    reports = broker.consume(CONTROLPLANE_QUEUE, prefetch=50, timeout=50)
    completed: Counter[str] = Counter()
    completed_by: dict[str, str] = {}
    try:
        started: set[str] = set()
        deadline = time.monotonic() + 120
        while started != set(ids) and time.monotonic() < deadline:
            message = next(reports)
            if message is None:
                continue
            assert message.actor_name == RECORD_STARTED_ACTOR  # none finishes this early
            started.update(start["request_id"] for start in message.args[0]["starts"])
            reports.ack(message)
        assert started == set(ids)
        [follower] = followers_of(node_a.pid)
        node_a_output = ""
        try:
            subprocess.run(["kill", "-KILL", str(follower)], check=True)
            node_a_output, _ = node_a.communicate(timeout=60)
        finally:
            assert node_a.returncode not in (None, 0), node_a_output
        assert "GroupFailure" in node_a_output and "rank 1 exited" in node_a_output
        assert gone(follower)

        node_b = start_node(tiny_llama_dir, broker, "node-b", "--tensor-parallel", "2")
        deadline = time.monotonic() + 180
        while sum(completed.values()) < len(ids) and time.monotonic() < deadline:
            message = next(reports)
            if message is None:
                continue
            if message.actor_name == RECORD_COMPLETION_ACTOR:
                for result in results_of(message.args[0]):
                    completed[result.request_id] += 1
                    completed_by[result.request_id] = result.node
            reports.ack(message)
        # A late duplicate would come within the node's report window: give it one.
        time.sleep(1)
        while (message := next(reports)) is not None:
            if message.actor_name == RECORD_COMPLETION_ACTOR:
                for result in results_of(message.args[0]):
                    completed[result.request_id] += 1
            reports.ack(message)
        # Drained and stopped, a group node stops its followers and exits cleanly.
        node_b_followers = followers_of(node_b.pid)
        node_b.send_signal(signal.SIGTERM)
        node_b_output, _ = node_b.communicate(timeout=60)
        assert node_b.returncode == 0, node_b_output
        assert node_b_followers and all(map(gone, node_b_followers))
    finally:
        reports.close()
        for node in (node_a, node_b):
            if node is not None and node.poll() is None:
                node.kill()
                node.communicate(timeout=60)
    assert completed == Counter(ids)
    assert set(completed_by.values()) == {"node-b"}


def test_a_group_node_may_take_a_disaggregated_role():
    # Each rank moves its share of the KV (tests/disagg/test_group_transfer.py).
    argv = ["--model", MODEL, "--tensor-parallel", "2"]
    for role in ("prefill", "decode"):
        args = parse_args([*argv, "--role", role])
        assert (args.tensor_parallel, args.role) == (2, role)

"""Disaggregation between groups as real processes: a prefill node and a decode node, each a group
of two ranks (`python -m inference.node --role prefill|decode --tensor-parallel 2`), over the
real Redis broker and the Transfer Engine. Each rank of the prefill group writes its heads' blocks
into the same rank of the decode group; the split requests answer the tokens a unified node gives
(float32), and the decode node counts them split (`prefill_node`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.disagg.nodes import MODEL, REDIS_URL, collect_results, enqueue, request
from tests.disagg.test_disagg_nodes import assert_same_output, unified_results

REPOSITORY = Path(__file__).resolve().parents[2]


def start_group(model_dir, broker, node_id: str, role: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "inference.node", "--model", MODEL, "--role", role]
    command += ["--source", str(model_dir), "--node-id", node_id, "--redis-url", REDIS_URL]
    command += ["--broker-namespace", broker.namespace, "--dtype", "float32"]
    command += ["--kv-cache-mb", "16", "--tensor-parallel", "2", "--kv-host", "127.0.0.1"]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPOSITORY
    )


def test_two_rank_groups_split_a_request_to_the_tokens_of_a_unified_node(tiny_llama_dir, broker):
    bodies = {
        "long": request("long", list(range(3, 203))),
        "short": request("short", list(range(40, 75))),
    }
    for body in bodies.values():
        enqueue(broker, body)
    groups = [
        start_group(tiny_llama_dir, broker, "prefill-1", "prefill"),
        start_group(tiny_llama_dir, broker, "decode-1", "decode"),
    ]
    try:
        split = collect_results(broker, len(bodies), timeout_s=180)
    finally:
        outputs = []
        for group in groups:
            group.terminate()
            try:
                outputs.append(group.communicate(timeout=30)[0])
            except subprocess.TimeoutExpired:
                group.kill()
                outputs.append(group.communicate()[0])
    assert set(split) == set(bodies), "\n".join(output[-3000:] for output in outputs)
    unified = unified_results(tiny_llama_dir, list(bodies.values()))
    for request_id, result in split.items():
        assert_same_output(result, unified[request_id])
        assert result["prefill_node"] == "prefill-1" and result["node"] == "decode-1"
    assert all(group.returncode == 0 for group in groups), [g.returncode for g in groups]

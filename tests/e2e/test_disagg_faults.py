"""Disaggregated prefill/decode in production mode (real gateway, worker, sweeper and node
processes on PostgreSQL and Redis, KV moved over the Mooncake Transfer Engine on loopback), with
nodes SIGKILLed or stalled (SIGSTOP) at the worst moments. Each test ends with every job
completed exactly once, one usage row each, the greedy tokens of unified mode, and every
surviving node's blocks free again (none leaked, none left held).
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from controlplane.billing.models import UsageRecord
from controlplane.jobs.models import Job
from inference.engine import LLM, SamplingParams
from inference.protocol.heartbeat import NODE_KEY_PREFIX
from tests.e2e.test_faults import post, reports_held
from tests.e2e.user_path import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

MAX_TOKENS = 24
KV_WAIT_S = "3"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi".split()  # noqa: SIM905


@pytest.fixture
def split_stack(stack):
    """The stack splitting prompts of 64 uncached tokens or more; a dead node's messages
    requeued after 3 s."""
    stack.env["HEARTH_BROKER_HEARTBEAT_TIMEOUT_MS"] = "3000"
    stack.env["HEARTH_DISAGG_MIN_TOKENS"] = "64"
    # The gateway read the environment when it started: start it again with these.
    stack.processes["gateway"].terminate()
    stack.processes["gateway"].wait(timeout=20)
    stack.start_gateway()
    return stack


def start(stack, model: str, node_id: str, role: str) -> None:
    stack.start_node(model, node_id, "--role", role, "--kv-wait-s", KV_WAIT_S, threads=1)


def submit(
    stack,
    key: str,
    model: str,
    count: int,
    first: int = 0,
    words: int = 40,
    max_tokens: int = MAX_TOKENS,
) -> list[str]:
    """`count` async chat jobs whose prompts (about 190 tokens with 40 `words`, numbered from
    `first`: others than those numbered before, which the decode node caches) are split."""
    jobs = []
    for index in range(first, first + count):
        text = " ".join(WORDS[(index + i) % len(WORDS)] for i in range(words))
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "queue": True,
            "messages": [{"role": "user", "content": f"{index}: {text}"}],
        }
        jobs.append(post(f"{stack.url}/v1/chat/completions", key, body)["id"])
    return jobs


def node_states(stack) -> dict[str, dict]:
    client = stack.redis()
    states = {}
    for key in client.scan_iter(match=NODE_KEY_PREFIX + "*"):
        raw = client.get(key)
        if raw:
            state = json.loads(raw)
            states[state["id"]] = state
    return states


def assert_completed_once_with_unified_tokens(stack, model_dir, job_ids: list[str]) -> list[Job]:
    wait_for(
        lambda: Job.objects.filter(id__in=job_ids, status=Job.COMPLETED).count() == len(job_ids),
        timeout_s=150,
        what="every job completed",
    )
    wait_for(lambda: reports_held(stack) == 0, what="the worker to record every report")
    jobs = list(Job.objects.filter(id__in=job_ids))
    assert all(job.status == Job.COMPLETED for job in jobs)
    requests = [job.request_id for job in jobs]
    assert UsageRecord.objects.filter(request_id__in=requests).count() == len(jobs)
    llm = LLM(str(model_dir), dtype="float32")
    for job in jobs:
        params = SamplingParams(temperature=0.0, max_tokens=job.sampling["max_tokens"])
        [want] = llm.generate([job.prompt_token_ids], params)
        assert job.result["token_ids"] == want.token_ids, job.id
        usage = job.result["usage"]
        assert 0 <= usage["cached_tokens"] < usage["prompt_tokens"]
        record = UsageRecord.objects.get(request_id=job.request_id)
        assert record.cached_tokens == usage["cached_tokens"]
    return jobs


def assert_blocks_back(stack, node_ids: list[str]) -> None:
    """Every block of each node free again once the holds have passed (kv_wait + grace)."""

    def back() -> bool:
        states = node_states(stack)
        return all(
            node_id in states
            and states[node_id]["free_blocks"] == states[node_id]["num_blocks"]
            and not states[node_id].get("held_blocks")
            for node_id in node_ids
        )

    wait_for(back, timeout_s=40, what=f"{node_ids}' blocks all free")


def start_pair(stack, model: str, key: str) -> None:
    """decode-a and prefill-a started, and both heartbeating."""
    start(stack, model, "decode-a", "decode")
    start(stack, model, "prefill-a", "prefill")
    stack.wait_ready(model, nodes=2, api_key=key)
    wait_for(lambda: {"decode-a", "prefill-a"} <= set(node_states(stack)), what="both heartbeats")


def explain(stack) -> None:
    """What a failed test prints: every process's log, the jobs' routes, the nodes' states."""
    print(stack.outputs())
    print(list(Job.objects.values_list("status", "route", "queue", "prefill_queue", "node")))
    print(node_states(stack))


def test_prefill_nodes_killed_mid_prefill_leave_every_job_to_another_prefill_node_or_the_decoder(
    split_stack, tiny_model, tiny_llama_dir, acme_key
):
    stack, model = split_stack, tiny_model.id
    start_pair(stack, model, acme_key)
    try:
        # prefill-a is stalled (as by a long step), then killed while it holds prompts; prefill-b
        # is up. Both hold nothing and report no load: the gateway sends every first attempt to
        # prefill-a (ties go to the first id). prefill-a stops once prefill-b beats and the jobs
        # go at once, while prefill-a's last heartbeat is live (stopped first, a slow start of
        # prefill-b outlasted it once, and every job went to prefill-b).
        start(stack, model, "prefill-b", "prefill")
        wait_for(lambda: "prefill-b" in node_states(stack), what="prefill-b's heartbeat")
        stack.processes["node-prefill-a"].send_signal(signal.SIGSTOP)
        job_ids = submit(stack, acme_key, model, 12)
        time.sleep(1)
        stack.processes["node-prefill-a"].send_signal(signal.SIGKILL)
        stack.processes["node-prefill-a"].wait(timeout=10)
        jobs = assert_completed_once_with_unified_tokens(stack, tiny_llama_dir, job_ids)
        assert all(job.node == "decode-a" for job in jobs)
        # After kv_wait_s, decode-a asked again under epoch 2 on the shared prefill queue, where
        # prefill-b took them (or, had it not in time, decode-a prefilled them itself).
        assert all(job.prefill_queue.endswith(".prefill-a") for job in jobs)
        assert all(job.prefill_node in (None, "prefill-b") for job in jobs)
        assert any(job.prefill_node == "prefill-b" for job in jobs), [j.prefill_node for j in jobs]
        # Killed mid-transfer and its answer lost: prefill-b is killed as soon as it starts.
        more = submit(stack, acme_key, model, 6, first=100)
        wait_for(
            lambda: stack.log("node-prefill-b").count("prefilling") > len(jobs),
            what="prefill-b taking a new prompt",
        )
        stack.processes["node-prefill-b"].send_signal(signal.SIGKILL)
        stack.processes["node-prefill-b"].wait(timeout=10)
        start(stack, model, "prefill-c", "prefill")
        assert_completed_once_with_unified_tokens(stack, tiny_llama_dir, more)
        assert_blocks_back(stack, ["decode-a", "prefill-c"])
    except Exception:
        explain(stack)
        raise


def test_a_decode_node_killed_while_it_awaits_kv_and_while_it_decodes_loses_nothing(
    split_stack, tiny_model, tiny_llama_dir, acme_key
):
    stack, model = split_stack, tiny_model.id
    start_pair(stack, model, acme_key)
    try:
        # decode-a decodes: short chats (not split) generating 200 tokens, and split prompts
        # whose KV it has; then prefill-a stalls, so the split prompts sent next await their KV
        # when decode-a is killed.
        chats = submit(stack, acme_key, model, 8, first=200, words=2, max_tokens=200)
        first = submit(stack, acme_key, model, 4, first=300, words=34, max_tokens=48)
        wait_for(
            lambda: stack.log("node-prefill-a").count("prefilling") >= 4,
            what="the first prompts prefilled",
        )
        stack.processes["node-prefill-a"].send_signal(signal.SIGSTOP)
        later = submit(stack, acme_key, model, 6, first=400)
        # decode-a took them (their start notices recorded), and awaits their KV.
        wait_for(
            lambda: Job.objects.filter(id__in=later, status=Job.RUNNING).count() == len(later),
            what="decode-a running the later jobs",
        )
        stack.processes["node-decode-a"].send_signal(signal.SIGKILL)
        stack.processes["node-decode-a"].wait(timeout=10)
        stack.processes["node-prefill-a"].send_signal(signal.SIGCONT)
        start(stack, model, "decode-b", "decode")
        everything = chats + first + later
        jobs = assert_completed_once_with_unified_tokens(stack, tiny_llama_dir, everything)
        # What decode-a held ran again on decode-b (sent again by the broker or the sweeper).
        rerun = [job for job in jobs if job.attempts >= 2 or job.dispatches >= 2]
        assert rerun and all(job.node == "decode-b" for job in rerun)
        assert {job.id for job in rerun} >= set(later)
        # prefill-a's late writes to the dead decode-a failed or landed in a dead process;
        # decode-b's prompts were prefilled again.
        assert_blocks_back(stack, ["decode-b", "prefill-a"])
    except Exception:
        explain(stack)
        raise

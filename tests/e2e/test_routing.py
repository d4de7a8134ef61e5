"""Routing that keeps caches hot, on the production stack with two real nodes, driven by the
official `openai` package: an agent's conversation stays on the node holding its prefix (with
`x-session-affinity`, and without it by prefix-aware routing), survives that node's death, and
the gateway's counters show the hits per route decision."""

from __future__ import annotations

import os
import urllib.request

import openai
import pytest
import redis
from django.conf import settings

from controlplane.jobs.models import Job
from inference.protocol.heartbeat import NODE_KEY_PREFIX
from tests.e2e.user_path import wait_for
from tests.prometheus_scrape import route_samples

pytestmark = pytest.mark.django_db(transaction=True)

SYSTEM = "Paged attention stores keys and values in fixed-size blocks. " * 2


def two_nodes(stack, model_id: str, api_key: str) -> list[str]:
    """Start two nodes under ids of this run's own (the registry is shared on the machine)."""
    nodes = [f"route-{name}-{os.getpid()}" for name in ("a", "b")]
    for node in nodes:
        stack.start_node(model_id, node, threads=1)
    stack.wait_ready(model_id, nodes=2, api_key=api_key)
    return nodes


def take_turn(client, model_id: str, messages: list[dict], headers: dict) -> tuple[str, int]:
    """One agent turn: the answer joins the conversation, and a tool result follows it.
    Returns the node that served it and its cached prompt tokens."""
    raw = client.chat.completions.with_raw_response.create(
        model=model_id, messages=messages, max_tokens=3, temperature=0, extra_headers=headers
    )
    completion = raw.parse()
    cached = completion.usage.prompt_tokens_details.cached_tokens
    assert raw.headers["x-hearth-cached-tokens"] == str(cached)
    messages.append({"role": "assistant", "content": completion.choices[0].message.content})
    messages.append({"role": "user", "content": f"tool {len(messages)}"})
    return raw.headers["x-hearth-node"], cached


def routes_of(model_id: str) -> list[str]:
    return list(
        Job.objects.filter(model=model_id).order_by("created").values_list("route", flat=True)
    )


@pytest.fixture
def routing_keys(tiny_model):
    """Deletes the model's routing state and counters from the shared Redis afterwards."""
    yield
    client = redis.Redis.from_url(settings.DRAMATIQ_BROKER["OPTIONS"]["url"])
    for key in client.scan_iter(match=f"hearth:route:*{tiny_model.id}*"):
        client.delete(key)


def test_an_agent_session_stays_on_its_node_and_moves_once_when_it_dies(
    stack, tiny_model, acme_key, routing_keys
):
    two_nodes(stack, tiny_model.id, acme_key)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=acme_key, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Begin."}]
    affinity = {"x-session-affinity": "agent-7"}
    try:
        served = [take_turn(client, tiny_model.id, messages, affinity) for _ in range(3)]
        [first] = {node for node, _ in served}  # one node for the whole session
        assert served[0][1] == 0 and all(cached > 0 for _, cached in served[1:]), served

        stack.processes[f"node-{first}"].kill()
        heartbeats = redis.Redis.from_url(settings.DRAMATIQ_BROKER["OPTIONS"]["url"])
        wait_for(lambda: not heartbeats.exists(NODE_KEY_PREFIX + first), what="its heartbeat")

        after = [take_turn(client, tiny_model.id, messages, affinity) for _ in range(2)]
        [survivor] = {node for node, _ in after}
        assert survivor != first
        assert after[1][1] > 0, after  # the new node's cache hits from the next turn on
    except Exception:
        print(stack.outputs())
        raise
    wait_for(lambda: Job.objects.filter(model=tiny_model.id, status="completed").count() == 5)
    assert routes_of(tiny_model.id) == ["affinity"] * 3 + ["affinity_failover", "affinity"]


def test_without_the_header_prefix_aware_routing_keeps_the_conversation_on_its_node(
    stack, tiny_model, acme_key, routing_keys
):
    two_nodes(stack, tiny_model.id, acme_key)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=acme_key, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Begin."}]
    try:
        served = [take_turn(client, tiny_model.id, messages, {}) for _ in range(5)]
    except Exception:
        print(stack.outputs())
        raise
    [node] = {node for node, _ in served}
    assert served[0][1] == 0 and all(cached > 0 for _, cached in served[1:]), served
    wait_for(lambda: Job.objects.filter(model=tiny_model.id, status="completed").count() == 5)
    assert routes_of(tiny_model.id) == ["spread"] + ["prefix"] * 4
    jobs = Job.objects.filter(model=tiny_model.id)
    cached = sum(job.result["usage"]["cached_tokens"] for job in jobs if job.route == "prefix")
    assert {job.node for job in jobs} == {node}

    # The counters, as Prometheus reads them (incremented after each completion's commit).
    def prefix_counter(series: str) -> float | None:
        text = urllib.request.urlopen(f"{stack.url}/metrics", timeout=5).read().decode()
        return route_samples(text).get((series, tiny_model.id, "prefix"))

    wait_for(lambda: prefix_counter("hearth_route_requests_total") == 4, what="counters")
    assert prefix_counter("hearth_route_cached_tokens_total") == cached

"""Routing that keeps caches hot (dispatch/routing.py): session affinity with sticky failover,
prefix-aware routing on the nodes' heartbeat digests, and the route counters behind /metrics.
Routing state lives in the real Redis (under a prefix of each test's own) or in memory."""

from __future__ import annotations

import threading
import time
import uuid

import dramatiq
import pytest
import redis
from django.conf import settings as django_settings

from controlplane.catalog import registry
from controlplane.catalog.registry import MemoryRouteState, RedisRouteState, live_nodes
from controlplane.dispatch.routing import (
    AFFINITY,
    AFFINITY_FAILOVER,
    LEAST_LOADED,
    PREFIX,
    SHARED,
    SPREAD,
    choose_route,
    rendezvous_rank,
)
from controlplane.jobs.models import Job
from controlplane.jobs.settlement import record_completion
from controlplane.metrics import TOKENS_KEY_PREFIX, route_counters
from inference.engine import EngineConfig, LLMEngine
from inference.engine.block_hash import compute_block_hashes
from inference.node.node import Node
from inference.protocol.heartbeat import (
    MemoryHeartbeat,
    decode_prefix_digest,
    encode_prefix_digest,
)
from inference.protocol.keyed_messages import KeyedRedisBroker
from inference.protocol.messages import CONTROLPLANE_QUEUE, GENERATE_ACTOR, model_queue, node_queue
from tests.controlplane.conftest import priced_model
from tests.controlplane.test_jobs_billing import make_job, result_for
from tests.prometheus_scrape import route_samples

REDIS_URL = django_settings.DRAMATIQ_BROKER["OPTIONS"]["url"]
MODEL = "tiny"
NODES = ["node-a", "node-b", "node-c"]


def state_of(node_id: str, free_slots: int = 8, cached: list[bytes] = (), **extra) -> dict:
    """A node's heartbeat state as `registry.live_nodes` returns it (digest decoded)."""
    state = {
        "id": node_id,
        "model": MODEL,
        "free_slots": free_slots,
        "max_num_seqs": 8,
        "running": 8 - free_slots,
        "waiting": 0,
        "free_blocks": 100,
        "num_blocks": 100,
        "block_size": 16,
        "cached_prefix_digest": encode_prefix_digest(cached),
        **extra,
    }
    return registry._with_digest(state)


def session_first_on(node_id: str, node_ids: list[str], name: str = "s") -> str:
    """A session id (starting with `name`) whose rendezvous ranking puts `node_id` first."""
    return next(
        s for s in (f"{name}{i}" for i in range(1000)) if rendezvous_rank(s, node_ids)[0] == node_id
    )


# ---- session affinity ----------------------------------------------------------------------


def test_a_session_goes_to_the_first_node_of_its_ranking_on_every_gateway(redis_state):
    nodes = [state_of(n) for n in NODES]
    session = session_first_on("node-b", NODES)
    # Another gateway process: another client of the same Redis.
    other_gateway = RedisRouteState(redis.Redis.from_url(REDIS_URL), redis_state.prefix)
    for state in (redis_state, other_gateway, redis_state):
        route = choose_route(MODEL, nodes, session, [1, 2, 3], "acme", state)
        assert (route.node, route.decision) == ("node-b", AFFINITY)
        assert route.queue == node_queue(MODEL, "node-b") and route.has_room


def test_a_session_whose_node_dies_moves_to_its_next_node_and_stays_there(redis_state):
    session = session_first_on("node-a", NODES)
    second = rendezvous_rank(session, NODES)[1]
    everyone = [state_of(n) for n in NODES]
    assert choose_route(MODEL, everyone, session, None, "", redis_state).node == "node-a"

    without_a = [n for n in everyone if n["id"] != "node-a"]  # its heartbeat expired
    route = choose_route(MODEL, without_a, session, None, "", redis_state)
    assert (route.node, route.decision) == (second, AFFINITY_FAILOVER)  # it moved
    route = choose_route(MODEL, without_a, session, None, "", redis_state)
    assert (route.node, route.decision) == (second, AFFINITY)  # first of the live nodes

    # node-a is back: the session keeps its new node (and the cache it has built there).
    for _ in range(3):
        route = choose_route(MODEL, everyone, session, None, "", redis_state)
        assert (route.node, route.decision) == (second, AFFINITY_FAILOVER)
    # Other sessions of node-a go back to it.
    fresh = session_first_on("node-a", NODES, name="fresh")
    assert choose_route(MODEL, everyone, fresh, None, "", redis_state).node == "node-a"


def test_a_session_leaves_a_busy_node_and_does_not_bounce_back(redis_state):
    session = session_first_on("node-a", NODES)
    second = rendezvous_rank(session, NODES)[1]
    assert choose_route(MODEL, [state_of(n) for n in NODES], session, None, "", redis_state)
    busy_a = [state_of("node-a", free_slots=0)] + [state_of(n) for n in NODES[1:]]
    assert choose_route(MODEL, busy_a, session, None, "", redis_state).node == second
    recovered = [state_of(n) for n in NODES]
    assert choose_route(MODEL, recovered, session, None, "", redis_state).node == second


def test_a_node_short_of_kv_blocks_is_busy_too(redis_state, settings):
    settings.ROUTING_MAX_LOAD = 0.9
    session = session_first_on("node-a", NODES)
    second = rendezvous_rank(session, NODES)[1]
    nodes = [state_of("node-a", free_blocks=5)] + [state_of(n) for n in NODES[1:]]
    assert choose_route(MODEL, nodes, session, None, "", redis_state).node == second
    # Below the threshold it is not.
    other = session_first_on("node-a", NODES, name="other")
    nodes = [state_of("node-a", free_blocks=11)] + [state_of(n) for n in NODES[1:]]
    assert choose_route(MODEL, nodes, other, None, "", redis_state).node == "node-a"


def test_when_every_node_is_busy_a_session_waits_on_its_own_node(redis_state):
    session = session_first_on("node-c", NODES)
    busy = [state_of(n, free_slots=0) for n in NODES]
    route = choose_route(MODEL, busy, session, None, "", redis_state)
    assert (route.node, route.decision, route.has_room) == ("node-c", AFFINITY, False)


def test_a_sessions_node_is_kept_for_an_hour_after_its_last_request(redis_state, settings):
    session = session_first_on("node-a", NODES)
    choose_route(MODEL, [state_of(n) for n in NODES[1:]], session, None, "", redis_state)
    [key] = redis_state.client.keys(redis_state.prefix + "session:*")
    assert 3590_000 < redis_state.client.pttl(key) <= 3600_000
    redis_state.client.pexpire(key, 5000)
    choose_route(MODEL, [state_of(n) for n in NODES], session, None, "", redis_state)
    assert redis_state.client.pttl(key) > 3590_000  # renewed on use
    redis_state.client.delete(key)  # expired: the session starts again from its ranking
    route = choose_route(MODEL, [state_of(n) for n in NODES], session, None, "", redis_state)
    assert (route.node, route.decision) == ("node-a", AFFINITY)


def test_without_live_nodes_a_request_waits_on_the_shared_queue(redis_state):
    route = choose_route(MODEL, [], "session", list(range(100)), "acme", redis_state)
    assert (route.queue, route.node, route.decision, route.has_room) == (
        model_queue(MODEL),
        None,
        SHARED,
        False,
    )


# ---- prefix-aware routing ------------------------------------------------------------------

PROMPT = list(range(3, 3 + 100))  # six full 16-token blocks, and four tokens more


def test_the_node_holding_the_longest_prefix_gets_the_prompt(redis_state):
    hashes = compute_block_hashes(PROMPT, 16, "acme")
    nodes = [
        state_of("node-a", cached=hashes[:2]),
        state_of("node-b", cached=hashes[:5]),
        state_of("node-c", cached=hashes[1:6]),  # its first block was evicted: no prefix
    ]
    route = choose_route(MODEL, nodes, None, PROMPT, "acme", redis_state)
    assert (route.node, route.decision) == ("node-b", PREFIX)
    assert route.queue == node_queue(MODEL, "node-b")


def test_another_orgs_cache_is_no_prefix(redis_state):
    hashes = compute_block_hashes(PROMPT, 16, "globex")
    nodes = [state_of("node-a", cached=hashes), state_of("node-b")]
    route = choose_route(MODEL, nodes, None, PROMPT, "acme", redis_state)
    assert route.decision == SPREAD


def test_a_busy_node_with_the_prefix_loses_to_a_less_loaded_one(settings):
    settings.ROUTING_MAX_LOAD = 0.75
    # A fresh routing state each time: only the heartbeats' digests say where the prefix is.
    hashes = compute_block_hashes(PROMPT, 16, "acme")
    nodes = [
        state_of("node-a", free_slots=1, cached=hashes),  # 7 of 8 slots in use
        state_of("node-b", free_slots=3, cached=hashes[:1]),  # 5 of 8
        state_of("node-c", free_slots=6),
    ]
    # The fit node with the longer prefix wins over the busy one.
    route = choose_route(MODEL, nodes, None, PROMPT, "acme", MemoryRouteState())
    assert (route.node, route.decision) == ("node-b", PREFIX)
    # No fit node holds any: the least loaded one.
    nodes[1] = state_of("node-b", free_slots=1, cached=hashes[:1])
    route = choose_route(MODEL, nodes, None, PROMPT, "acme", MemoryRouteState())
    assert (route.node, route.decision) == ("node-c", LEAST_LOADED)
    # Every node busy: wait where the longest prefix is.
    nodes[2] = state_of("node-c", free_slots=0)
    route = choose_route(MODEL, nodes, None, PROMPT, "acme", MemoryRouteState())
    assert (route.node, route.decision) == ("node-a", PREFIX)


def test_new_conversations_sharing_a_cached_system_prompt_spread_and_stay(redis_state):
    system = list(range(200, 264))  # four blocks every node caches
    cached = compute_block_hashes(system, 16, "acme")
    # Loads differ: ties still spread, since heartbeat loads are seconds old.
    nodes = [state_of("node-a", free_slots=2, cached=cached), state_of("node-b", cached=cached)]
    chosen = {}
    for conversation in range(20):
        route = choose_route(
            MODEL, nodes, None, [*system, conversation, *PROMPT], "acme", redis_state
        )
        assert route.decision == PREFIX
        chosen[conversation] = route.node
    assert set(chosen.values()) == {"node-a", "node-b"}
    for conversation, node in chosen.items():
        next_turn = [*system, conversation, *PROMPT, 7, 8, 9]
        assert choose_route(MODEL, nodes, None, next_turn, "acme", redis_state).node == node


def test_new_prompts_spread_over_the_nodes_and_their_next_turn_follows(redis_state):
    nodes = [state_of(n) for n in NODES]
    chosen = {}
    for conversation in range(30):
        prompt = [conversation + 3, *PROMPT]
        route = choose_route(MODEL, nodes, None, prompt, "acme", redis_state)
        assert route.decision == SPREAD
        chosen[conversation] = route.node
    assert set(chosen.values()) == set(NODES)
    # The next turns come before any heartbeat shows their blocks: the gateway remembers.
    for conversation, node in chosen.items():
        next_turn = [conversation + 3, *PROMPT, 500, 501, 502]
        route = choose_route(MODEL, nodes, None, next_turn, "acme", redis_state)
        assert (route.node, route.decision) == (node, PREFIX)


def test_a_prompt_shorter_than_a_block_goes_to_the_shared_queue(redis_state):
    route = choose_route(MODEL, [state_of("node-a")], None, [3, 4, 5], "acme", redis_state)
    assert (route.node, route.decision) == (None, SHARED)


def test_the_digest_keeps_8_bytes_of_each_hash():
    hashes = compute_block_hashes(list(range(16 * 4096)), 16, "acme")
    digest = encode_prefix_digest(hashes)
    assert decode_prefix_digest(digest) == {h[:8] for h in hashes}
    assert len(digest) == 43_692  # base64 of 4,096 × 8 bytes
    assert decode_prefix_digest("") == frozenset()


def test_a_real_nodes_heartbeat_routes_the_next_turn_to_it(tiny_llama_dir):
    """The node's digest and the gateway's hashes agree: same function, namespace (the org)
    and block size, through the node's own heartbeat and the registry."""
    broker = KeyedRedisBroker(url=REDIS_URL, namespace=f"hearth-test-{uuid.uuid4().hex[:8]}")
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256))
    heartbeat = MemoryHeartbeat()
    node = Node(engine, MODEL, "node-real", broker, heartbeat=heartbeat)
    prompt = list(range(3, 3 + 70))
    broker.enqueue(
        dramatiq.Message(
            queue_name=model_queue(MODEL),
            actor_name=GENERATE_ACTOR,
            args=(
                {
                    "request_id": "req-1",
                    "job_id": "job-1",
                    "org": "acme",
                    "prompt_token_ids": prompt,
                    "sampling": {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True},
                    "reply_channel": None,
                    "deadline": None,
                    "attempt": 1,
                },
            ),
            kwargs={},
            options={},
        )
    )
    stop = threading.Event()
    thread = threading.Thread(target=node.run, args=(stop,), daemon=True)
    thread.start()
    try:
        results = broker.consume(CONTROLPLANE_QUEUE, prefetch=10, timeout=100)
        deadline = time.time() + 60
        while time.time() < deadline:
            message = next(results)
            if message is not None:
                results.ack(message)
                if message.actor_name == "record_completion":
                    break
        else:
            pytest.fail("no result from the node")
        results.close()
        node.beat(force=True)
        other = {**heartbeat.live_nodes()["node-real"], "id": "node-other"}
        heartbeat("node-other", {**other, "cached_prefix_digest": ""}, ttl_s=60)
        registry.use_memory_heartbeat(heartbeat)
        nodes = live_nodes(MODEL)
        next_turn = [*prompt, 200, 201, 202, 203]
        route = choose_route(MODEL, nodes, None, next_turn, "acme", MemoryRouteState())
        assert (route.node, route.decision) == ("node-real", PREFIX)
        route = choose_route(MODEL, nodes, None, next_turn, "globex", MemoryRouteState())
        assert route.decision == SPREAD
    finally:
        registry.use_memory_heartbeat(None)
        stop.set()
        thread.join(timeout=30)
        broker.flush_all()
        broker.close()


# ---- route counters --------------------------------------------------------------------------


@pytest.fixture
def redis_counters(db, settings):
    """The counters in the real Redis, for a priced model of this test's own."""
    settings.REDIS_URL = REDIS_URL
    model = f"tiny-routing-{uuid.uuid4().hex[:8]}"
    priced_model(model, model, 8192)
    yield model
    redis.Redis.from_url(REDIS_URL).delete(TOKENS_KEY_PREFIX + model)


def test_a_completion_adds_its_tokens_to_its_decisions_counters_once(
    org_a, redis_counters, django_capture_on_commit_callbacks, client
):
    model = redis_counters
    prefix_job = make_job(org_a, model=model, route=PREFIX)
    spread_job = make_job(org_a, model=model, route=SPREAD)
    with django_capture_on_commit_callbacks(execute=True):  # its prompt computed on prefill-1
        split = result_for(prefix_job, prompt=1000, cached=960, prefill_node="prefill-1")
        assert record_completion(split)
    with django_capture_on_commit_callbacks(execute=True):
        assert not record_completion(result_for(prefix_job))  # a redelivery
    with django_capture_on_commit_callbacks(execute=True):
        assert record_completion(result_for(spread_job, prompt=500, cached=0))
    assert route_counters()[model] == {
        PREFIX: {"requests": 1, "prompt_tokens": 1000, "cached_tokens": 960, "disaggregated": 1},
        SPREAD: {"requests": 1, "prompt_tokens": 500, "cached_tokens": 0, "disaggregated": 0},
    }
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response["content-type"].startswith("text/plain; version=0.0.4")
    text = response.content.decode()
    assert "# TYPE hearth_route_cached_tokens_total counter" in text
    samples = route_samples(text)
    assert samples["hearth_route_cached_tokens_total", model, "prefix"] == 960
    assert samples["hearth_route_prompt_tokens_total", model, "spread"] == 500
    assert samples["hearth_route_requests_total", model, "prefix"] == 1
    assert samples["hearth_route_disaggregated_requests_total", model, "prefix"] == 1
    assert samples["hearth_route_disaggregated_requests_total", model, "spread"] == 0
    # Prometheus asks for OpenMetrics first: the same counters in that format.
    response = client.get("/metrics", HTTP_ACCEPT="application/openmetrics-text; version=1.0.0")
    assert response["content-type"].startswith("application/openmetrics-text")
    samples = route_samples(response.content.decode(), response["content-type"])
    assert samples["hearth_route_cached_tokens_total", model, "prefix"] == 960
    assert samples["hearth_route_requests_total", model, "spread"] == 1


def test_a_failed_job_counts_nothing(org_a, redis_counters, django_capture_on_commit_callbacks):
    job = make_job(org_a, model=redis_counters, route=PREFIX)
    with django_capture_on_commit_callbacks(execute=True):
        record_completion(result_for(job, error="boom"))
    assert redis_counters not in route_counters()


@pytest.mark.django_db(transaction=True)  # admission reads the key on a connection of its own
def test_admission_stores_the_route_decision_on_the_job(org_a, key_a, tiny, client):
    heartbeat = MemoryHeartbeat()
    for node in ("node-1", "node-2"):
        heartbeat(node, {**state_of(node), "model": "tiny"}, ttl_s=60)
    registry.use_memory_heartbeat(heartbeat)
    try:
        response = client.post(
            "/v1/completions",
            {"model": "tiny", "prompt": "hello " * 8, "max_tokens": 2, "queue": True},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {key_a}",
        )
        assert response.status_code == 202, response.content
        job = Job.objects.get(id=response.json()["id"])
        assert job.route == SPREAD and job.queue in {
            node_queue("tiny", "node-1"),
            node_queue("tiny", "node-2"),
        }
        response = client.post(
            "/v1/completions",
            {"model": "tiny", "prompt": "hello " * 8 + "again", "max_tokens": 2, "queue": True},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {key_a}",
            HTTP_X_SESSION_AFFINITY="conversation-1",
        )
        assert response.status_code == 202, response.content
        assert Job.objects.get(id=response.json()["id"]).route in {AFFINITY, AFFINITY_FAILOVER}
    finally:
        registry.use_memory_heartbeat(None)
        for node in ("node-1", "node-2"):
            dramatiq.get_broker().flush(node_queue("tiny", node))


def test_metrics_answer_only_the_metrics_token_when_one_is_set(client, settings):
    settings.METRICS_TOKEN = "m3trics-t0ken"
    assert client.get("/metrics").status_code == 401
    wrong = client.get("/metrics", HTTP_AUTHORIZATION="Bearer not-it")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_token"
    right = client.get("/metrics", HTTP_AUTHORIZATION="Bearer m3trics-t0ken")
    assert right.status_code == 200 and "hearth_route_requests_total" in right.content.decode()
    settings.METRICS_TOKEN = ""
    assert client.get("/metrics").status_code == 200  # unset: open, for the private network

"""The control plane's side of disaggregated prefill and decode: which requests a prefill node
computes (dispatch/disaggregation.py) and which it never gets (dispatch/routing.py), the split in
the generation message and its redelivery, `runnode --role`, the job's prefill node, the
`x-hearth-prefill-node` header and the per-node metrics. Heartbeat states are built as the
routing tests build them; routing state lives in the real Redis or in memory."""

from __future__ import annotations

import threading

import dramatiq
import pytest
from asgiref.sync import async_to_sync
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from prometheus_client import parser

from controlplane.catalog.management.commands.runnode import Command as RunNode
from controlplane.catalog.management.commands.runnode import node_argv
from controlplane.catalog.registry import DECODE, PREFILL, UNIFIED, MemoryRouteState
from controlplane.dispatch.disaggregation import split
from controlplane.dispatch.redelivery import _dispatch_again
from controlplane.dispatch.routing import AFFINITY, PREFIX, SHARED, SPREAD, choose_route
from controlplane.jobs.models import Job
from controlplane.jobs.settlement import record_completion
from inference.engine.block_hash import compute_block_hashes
from inference.node.__main__ import parse_args
from inference.protocol.heartbeat import MemoryHeartbeat
from inference.protocol.messages import (
    GenerationRequest,
    model_queue,
    node_queue,
    prefill_node_queue,
)
from tests.controlplane.test_jobs_billing import make_job, result_for
from tests.controlplane.test_openapi import schema_validator
from tests.controlplane.test_routing import MODEL, session_first_on
from tests.controlplane.test_routing import state_of as routing_state_of
from tests.waiting import wait_for

LAYOUT = {
    "model": MODEL,
    "dtype": "float32",
    "block_size": 16,
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
}
LONG = list(range(3, 3 + 600))  # 37 full blocks and 8 tokens: none cached anywhere yet


def state_of(node_id: str, role: str = DECODE, layout: dict | None = LAYOUT, **extra) -> dict:
    """A node's heartbeat state with its role and KV layout (`layout` None: an old node's
    heartbeat, without one)."""
    if layout is not None:
        extra["kv_layout"] = layout
    return routing_state_of(node_id, role=role, **extra)


@pytest.fixture(autouse=True)
def thresholds(settings):
    """The shipped defaults, stated here: the tests below are about these numbers."""
    settings.DISAGG_MIN_TOKENS = 512
    settings.DISAGG_MAX_QUEUED_TOKENS = 16384
    settings.ROUTING_MAX_LOAD = 0.9


def routed(nodes, prompt, state, session=None, namespace="acme"):
    """The route of `prompt` as admission takes it: decode route, then the split."""
    route = choose_route(MODEL, nodes, session, prompt, namespace, state)
    return split(MODEL, nodes, route, prompt, namespace, state)


# ---- which requests split -------------------------------------------------------------------


def test_a_long_uncached_prompt_is_prefilled_on_a_prefill_node(redis_state):
    nodes = [state_of("decode-a"), state_of("decode-b"), state_of("prefill-1", PREFILL)]
    route = routed(nodes, LONG, redis_state)
    # The decode route is the one routing alone takes; the split only adds the prefill queue.
    assert route.decision == SPREAD and route.node in {"decode-a", "decode-b"}
    assert route.queue == node_queue(MODEL, route.node)
    assert route.prefill_queue == prefill_node_queue(MODEL, "prefill-1")


def test_the_threshold_counts_prompt_tokens(redis_state):
    nodes = [state_of("decode-a"), state_of("prefill-1", PREFILL)]
    assert routed(nodes, LONG[:511], redis_state).prefill_queue is None
    assert routed(nodes, LONG[:512], MemoryRouteState()).prefill_queue is not None


def test_the_decode_nodes_cached_prefix_does_not_count(redis_state, settings):
    hashes = compute_block_hashes(LONG, 16, "acme")
    nodes = [state_of("decode-a", cached=hashes[:10]), state_of("prefill-1", PREFILL)]
    # 600 tokens, 160 of them cached on decode-a: 440 to compute, under 512.
    route = routed(nodes, LONG, redis_state)
    assert (route.node, route.decision, route.cached_tokens) == ("decode-a", PREFIX, 160)
    assert route.prefill_queue is None
    settings.DISAGG_MIN_TOKENS = 440
    route = routed(nodes, LONG, MemoryRouteState())
    assert route.prefill_queue == prefill_node_queue(MODEL, "prefill-1")


def test_a_sessions_node_holding_the_history_prefills_the_next_turn_itself(redis_state):
    session = session_first_on("decode-a", ["decode-a", "decode-b"])
    history = compute_block_hashes(LONG, 16, "acme")
    nodes = [
        state_of("decode-a", cached=history),
        state_of("decode-b"),
        state_of("prefill-1", PREFILL),
    ]
    next_turn = [*LONG, *range(700, 800)]  # 100 new tokens after 592 cached
    route = routed(nodes, next_turn, redis_state, session=session)
    assert (route.node, route.decision) == ("decode-a", AFFINITY)
    assert route.prefill_queue is None
    # The same session's first turn, nothing cached: split.
    nodes[0] = state_of("decode-a")
    route = routed(nodes, next_turn, MemoryRouteState(), session=session)
    assert route.node == "decode-a" and route.prefill_queue is not None


def test_a_turn_sent_before_its_node_beat_counts_as_cached_there(redis_state):
    """The gateway remembers where it sent a prompt (routing.py): the next turn, before any
    heartbeat shows the blocks, is expected cached on that node, and not split again."""
    nodes = [state_of("decode-a"), state_of("decode-b"), state_of("prefill-1", PREFILL)]
    first = routed(nodes, LONG, redis_state)
    assert first.prefill_queue is not None
    next_turn = [*LONG, *range(700, 800)]
    route = routed(nodes, next_turn, redis_state)
    assert (route.node, route.decision, route.prefill_queue) == (first.node, PREFIX, None)


@pytest.mark.parametrize(
    "prefill_pool",
    [
        pytest.param([], id="no prefill node"),
        pytest.param([state_of("prefill-1", PREFILL, free_slots=0)], id="busy in slots"),
        pytest.param([state_of("prefill-1", PREFILL, free_blocks=5)], id="busy in KV blocks"),
        pytest.param([state_of("prefill-1", PREFILL, queued_tokens=16384)], id="tokens queued"),
        pytest.param(
            [state_of("prefill-1", PREFILL, layout={**LAYOUT, "dtype": "bfloat16"})],
            id="another layout",
        ),
        pytest.param([state_of("prefill-1", PREFILL, layout=None)], id="no layout"),
        pytest.param(
            [
                state_of(
                    "prefill-1",
                    PREFILL,
                    layout={**LAYOUT, "tensor_parallel": 2, "total_kv_heads": 4},
                )
            ],
            id="another model's KV heads",
        ),
    ],
)
def test_without_a_fit_prefill_node_the_decode_node_prefills(redis_state, prefill_pool):
    nodes = [state_of("decode-a"), *prefill_pool]
    route = routed(nodes, LONG, redis_state)
    assert (route.node, route.prefill_queue) == ("decode-a", None)
    assert route.queue == node_queue(MODEL, "decode-a")


@pytest.mark.parametrize(
    "layout",
    [
        # Each rank of the group caches one of the two KV heads: placed head by head.
        pytest.param(LAYOUT, id="KV heads"),
        # MLA's latent cache is whole on every rank.
        pytest.param({**LAYOUT, "kinds": 1, "num_kv_heads": 1, "head_dim": 40}, id="latent"),
    ],
)
def test_groups_of_different_sizes_pair(redis_state, layout):
    group = {**layout, "tensor_parallel": 2, "total_kv_heads": layout["num_kv_heads"]}
    if layout.get("kinds", 2) == 2:
        group["num_kv_heads"] = 1
    nodes = [
        state_of("decode-a", layout=layout),
        state_of("prefill-1", PREFILL, layout=group),
    ]
    route = routed(nodes, LONG, redis_state)
    assert route.prefill_queue == prefill_node_queue(MODEL, "prefill-1")


def test_a_decode_node_without_a_layout_is_never_split(redis_state):
    nodes = [state_of("decode-a", layout=None), state_of("prefill-1", PREFILL)]
    assert routed(nodes, LONG, redis_state).prefill_queue is None


def test_a_prefill_node_just_under_its_token_limit_still_takes_prompts(redis_state):
    nodes = [state_of("decode-a"), state_of("prefill-1", PREFILL, queued_tokens=16383)]
    assert routed(nodes, LONG, redis_state).prefill_queue == prefill_node_queue(MODEL, "prefill-1")


def test_the_prefill_node_holding_the_longest_prefix_takes_the_prompt(redis_state):
    hashes = compute_block_hashes(LONG, 16, "acme")
    nodes = [
        state_of("decode-a"),
        state_of("prefill-1", PREFILL, cached=hashes[:10], queued_tokens=0),
        state_of("prefill-2", PREFILL, cached=hashes[:20], queued_tokens=8000),
        state_of("prefill-3", PREFILL, cached=hashes[5:30], queued_tokens=0),  # no prefix
    ]
    route = routed(nodes, LONG, redis_state)
    assert route.prefill_queue == prefill_node_queue(MODEL, "prefill-2")


def test_another_orgs_prefix_on_a_prefill_node_is_no_prefix(redis_state):
    theirs = compute_block_hashes(LONG, 16, "globex")
    nodes = [
        state_of("decode-a"),
        state_of("prefill-1", PREFILL, cached=theirs, queued_tokens=4000),
        state_of("prefill-2", PREFILL, queued_tokens=100),
    ]
    route = routed(nodes, LONG, redis_state)
    assert route.prefill_queue == prefill_node_queue(MODEL, "prefill-2")


def test_equal_prefixes_go_to_the_prefill_node_with_the_fewest_queued_tokens(redis_state):
    system = compute_block_hashes(LONG, 16, "acme")[:4]
    nodes = [
        state_of("decode-a"),
        state_of("prefill-1", PREFILL, cached=system, queued_tokens=3000),
        state_of("prefill-2", PREFILL, cached=system, queued_tokens=1200),
        state_of("prefill-3", PREFILL, cached=system, queued_tokens=2000),
        state_of("prefill-4", PREFILL, queued_tokens=0),  # idle, but holds nothing
    ]
    route = routed(nodes, LONG, redis_state)
    assert route.prefill_queue == prefill_node_queue(MODEL, "prefill-2")


def test_prefill_nodes_never_get_generation_requests(redis_state):
    hashes = compute_block_hashes(LONG, 16, "acme")
    # The prefill nodes hold the whole prompt and have room; the decode nodes are busy.
    nodes = [
        state_of("decode-a", free_slots=0),
        state_of("unified-b", UNIFIED, free_slots=0),
        state_of("prefill-1", PREFILL, cached=hashes),
        state_of("prefill-2", PREFILL, cached=hashes),
    ]
    everyone = [n["id"] for n in nodes]
    for conversation in range(20):
        prompt = [conversation + 3, *LONG]
        session = session_first_on("prefill-1", everyone, name=f"c{conversation}-")
        route = choose_route(MODEL, nodes, session, prompt, "acme", redis_state)
        assert route.node in {"decode-a", "unified-b"}  # waits on its busy decode node
        assert not route.has_room  # the prefill nodes' free slots are no room
        route = choose_route(MODEL, nodes, None, prompt, "acme", redis_state)
        assert (route.queue, route.has_room) == (model_queue(MODEL), False)
    # Prefill nodes alone: the shared queue, where only decode nodes pull.
    route = routed(nodes[2:], LONG, redis_state)
    assert (route.queue, route.node, route.has_room) == (model_queue(MODEL), None, False)
    assert route.prefill_queue is None  # and no decode node to pair with


def test_on_the_shared_queue_the_whole_prompt_counts_when_every_decode_node_agrees(
    redis_state,
):
    busy = {"free_slots": 0}
    nodes = [
        state_of("decode-a", **busy),
        state_of("decode-b", DECODE, **busy),
        state_of("prefill-1", PREFILL),
    ]
    route = routed(nodes, LONG, redis_state)
    assert (route.decision, route.queue) == (SHARED, model_queue(MODEL))
    assert route.prefill_queue == prefill_node_queue(MODEL, "prefill-1")
    # Any decode node may pull from the shared queue: with two layouts, none is sure to pair.
    nodes[1] = state_of("decode-b", DECODE, layout={**LAYOUT, "block_size": 32}, **busy)
    assert routed(nodes, LONG, MemoryRouteState()).prefill_queue is None
    # A unified node may pull it too, and prefills what it takes itself: no split.
    nodes[1] = state_of("decode-b", UNIFIED, **busy)
    assert routed(nodes, LONG, MemoryRouteState()).prefill_queue is None


def test_a_request_routed_to_a_unified_node_is_never_split(redis_state):
    nodes = [state_of("unified-a", UNIFIED), state_of("prefill-1", PREFILL)]
    route = routed(nodes, LONG, redis_state)
    assert route.node == "unified-a" and route.prefill_queue is None


# ---- the generation message, admission and redelivery ---------------------------------------


def broker_messages(queue: str) -> list[dict]:
    """The generation messages waiting in `queue`, taken out of it."""
    broker = dramatiq.get_broker()
    consumer = broker.consume(queue, timeout=200)
    found = []
    while (message := next(consumer)) is not None:
        found.append(message.args[0])
        consumer.ack(message)
    consumer.close()
    return found


def beat(heartbeat: MemoryHeartbeat, state: dict, model: str = "tiny") -> None:
    heartbeat(state["id"], {**state, "model": model, "kv_layout": {**LAYOUT, "model": model}}, 60)


@pytest.mark.django_db(transaction=True)  # admission reads the key on a connection of its own
def test_admission_writes_the_split_into_the_job_and_its_message(
    org_a, key_a, tiny, client, live, settings
):
    settings.DISAGG_MIN_TOKENS = 16  # the tiny model's context is 64 tokens
    beat(live, state_of("decode-a"))
    beat(live, state_of("prefill-1", PREFILL))

    def submit(prompt: str) -> Job:
        response = client.post(
            "/v1/completions",
            {"model": "tiny", "prompt": prompt, "max_tokens": 2, "queue": True},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {key_a}",
        )
        assert response.status_code == 202, response.content
        return Job.objects.get(id=response.json()["id"])

    job = submit("hello " * 8)
    assert len(job.prompt_token_ids) >= 16
    assert job.queue == node_queue("tiny", "decode-a")
    assert job.prefill_queue == prefill_node_queue("tiny", "prefill-1")
    [message] = broker_messages(job.queue)
    assert message["prefill"] == {"queue": prefill_node_queue("tiny", "prefill-1")}
    assert GenerationRequest.from_message(message).prefill == message["prefill"]

    settings.DISAGG_MIN_TOKENS = 64
    job = submit("hello " * 8 + "again")
    assert job.prefill_queue == ""
    [message] = broker_messages(job.queue)
    assert "prefill" not in message  # unsplit messages are as they were


@pytest.mark.django_db(transaction=True)
def test_a_redispatched_job_decides_its_split_again(org_a, tiny, live, settings):
    settings.DISAGG_MIN_TOKENS = 16
    beat(live, state_of("decode-a"))
    beat(live, state_of("prefill-1", PREFILL))
    job = make_job(org_a, model="tiny")
    Job.objects.filter(pk=job.pk).update(
        prompt_token_ids=list(range(3, 40)),
        prefill_queue=prefill_node_queue("tiny", "prefill-gone"),  # dead since its dispatch
    )
    job.refresh_from_db()

    assert _dispatch_again(job) == 1
    job.refresh_from_db()
    assert job.prefill_queue == prefill_node_queue("tiny", "prefill-1")
    [message] = broker_messages(job.queue)
    assert message["prefill"] == {"queue": prefill_node_queue("tiny", "prefill-1")}

    live("prefill-1", None, 60)  # the prefill pool is empty now: unified
    assert _dispatch_again(job) == 1
    job.refresh_from_db()
    assert (job.prefill_queue, job.dispatches) == ("", 3)
    [message] = broker_messages(job.queue)
    assert "prefill" not in message


# ---- runnode --role ---------------------------------------------------------------------------


def runnode_argv(model, *args: str) -> list[str]:
    """The node's argv that `manage.py runnode --model <model> <args>` would run it with."""
    options = vars(RunNode().create_parser("manage.py", "runnode").parse_args(["--model", *args]))
    return node_argv(model, options)


@pytest.mark.parametrize("role", [UNIFIED, PREFILL, DECODE])
def test_runnode_runs_the_node_in_its_role(db, tiny, role):
    args = parse_args(runnode_argv(tiny, tiny.id, "--role", role, "--node-id", "n1"))
    assert (args.role, args.model, args.source, args.node_id) == (role, "tiny", tiny.source, "n1")


def test_runnode_runs_a_unified_node_unless_told(db, tiny):
    assert parse_args(runnode_argv(tiny, tiny.id)).role == UNIFIED


def test_runnode_refuses_an_unknown_role(db, tiny):
    with pytest.raises(CommandError, match="invalid choice: 'both'"):
        call_command("runnode", "--model", tiny.id, "--role", "both")


# ---- the job's nodes and the response headers ----------------------------------------------


def test_the_job_names_the_prefill_node_and_the_decode_node(org_a, smollm2, api, key_a):
    split_job, unified_job = make_job(org_a), make_job(org_a)
    assert record_completion(result_for(split_job, prefill_node="prefill-1"))
    assert record_completion(result_for(unified_job))
    job_schema = schema_validator(api.get("/openapi.json", key_a).json(), "Job")
    body = api.get(f"/v1/jobs/{split_job.id}", key_a).json()
    assert (body["node"], body["prefill_node"]) == ("node-1", "prefill-1")
    job_schema.validate(body)
    body = api.get(f"/v1/jobs/{unified_job.id}", key_a).json()
    assert (body["node"], body["prefill_node"]) == ("node-1", None)
    job_schema.validate(body)
    unified_job.refresh_from_db()
    assert unified_job.prefill_node is None


def test_a_redelivered_result_does_not_change_the_prefill_node(org_a, smollm2):
    job = make_job(org_a)
    assert record_completion(result_for(job, prefill_node="prefill-1"))
    assert not record_completion(result_for(job, prefill_node="prefill-2"))
    job.refresh_from_db()
    assert job.prefill_node == "prefill-1"


@pytest.fixture
def broker():
    yield dramatiq.get_broker()
    dramatiq.get_broker().flush_all()


def settle_when_admitted(node: str, prefill_node: str | None) -> threading.Thread:
    """Settle the next job admitted, from `node`'s result naming `prefill_node`, as the worker
    would while its request waits: the gateway finds no delta on the reply channel (no node runs
    here) and answers from the job's row, as it does when the deltas and `done` were lost."""

    def settle() -> None:
        try:
            job = wait_for(lambda: Job.objects.first(), "the admitted job")
            result = result_for(job, prompt=len(job.prompt_token_ids), cached=0)
            result.node, result.prefill_node = node, prefill_node
            assert record_completion(result)
        finally:
            connections.close_all()

    thread = threading.Thread(target=settle)
    thread.start()
    return thread


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], **fields}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_split_requests_answer_names_its_prefill_node(post, tiny, key_a, broker, stream):
    settler = settle_when_admitted("decode-a", "prefill-1")
    response = post("/v1/chat/completions", chat(stream=stream, max_tokens=2), key=key_a)
    settler.join()
    assert response.status_code == 200
    assert response["x-hearth-node"] == "decode-a"
    assert response["x-hearth-prefill-node"] == "prefill-1"
    if stream:

        async def read() -> bytes:
            return b"".join([part async for part in response.streaming_content])

        assert async_to_sync(read)().endswith(b"data: [DONE]\n\n")
    else:
        assert response.json()["choices"][0]["message"]["content"] == "hello"


@pytest.mark.django_db(transaction=True)
def test_an_unsplit_requests_answer_has_no_prefill_node_header(post, tiny, key_a, broker):
    settler = settle_when_admitted("decode-a", None)
    response = post("/v1/chat/completions", chat(max_tokens=2), key=key_a)
    settler.join()
    assert response.status_code == 200 and response["x-hearth-node"] == "decode-a"
    assert not response.has_header("x-hearth-prefill-node")


# ---- metrics -------------------------------------------------------------------------------


def test_metrics_show_each_nodes_disaggregation_counters_and_the_nodes_per_role(client, live):
    counters = {
        "requests": 12,
        "tokens_prefilled": 9000,
        "tokens_transferred": 8800,
        "blocks_transferred": 550,
        "bytes_transferred": 36_044_800,
        "transfer_seconds": 0.75,
        "blocks_reused": 30,
        "fallbacks": 1,
    }
    live("prefill-1", {**state_of("prefill-1", PREFILL), "disagg": counters}, 60)
    received = {**counters, "tokens_prefilled": 0, "fallbacks": 2}
    live("decode-a", {**state_of("decode-a"), "disagg": received}, 60)
    live("decode-b", {**state_of("decode-b"), "disagg": dict.fromkeys(counters, 0)}, 60)
    live("old-1", state_of("old-1", UNIFIED, layout=None), 60)  # no `disagg`: an older node
    other_model = {**state_of("other-1", UNIFIED), "model": "other"}
    live("other-1", {**other_model, "disagg": dict.fromkeys(counters, 0)}, 60)

    response = client.get("/metrics")
    assert response.status_code == 200
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in parser.text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    }

    def value(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    nodes = {
        role: value("hearth_nodes", model=MODEL, role=role) for role in (UNIFIED, PREFILL, DECODE)
    }
    assert nodes == {UNIFIED: 1, PREFILL: 1, DECODE: 2}
    assert value("hearth_nodes", model="other", role=PREFILL) == 0
    prefill = {"model": MODEL, "node": "prefill-1", "role": PREFILL}
    assert value("hearth_disagg_requests_total", **prefill) == 12
    assert value("hearth_disagg_tokens_prefilled_total", **prefill) == 9000
    assert value("hearth_disagg_tokens_transferred_total", **prefill) == 8800
    assert value("hearth_disagg_blocks_transferred_total", **prefill) == 550
    assert value("hearth_disagg_bytes_transferred_total", **prefill) == 36_044_800
    assert value("hearth_disagg_transfer_seconds_total", **prefill) == 0.75
    assert value("hearth_disagg_blocks_reused_total", **prefill) == 30
    assert value("hearth_disagg_fallbacks_total", **prefill) == 1
    decode = {"model": MODEL, "node": "decode-a", "role": DECODE}
    assert value("hearth_disagg_fallbacks_total", **decode) == 2
    assert value("hearth_disagg_tokens_prefilled_total", **decode) == 0
    assert value("hearth_disagg_requests_total", model=MODEL, node="decode-b", role=DECODE) == 0
    assert not [key for key in samples if ("node", "old-1") in key[1]]
    # The text is a counter family Prometheus reads as one.
    assert "# TYPE hearth_disagg_bytes_transferred_total counter" in response.content.decode()

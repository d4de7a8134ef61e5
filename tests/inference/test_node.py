"""The node against the real Redis: Dramatiq's Redis broker for work and results, the Channels
Redis layer for deltas. The engine is a tiny random model."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import dramatiq
import pytest
from asgiref.sync import async_to_sync
from channels_redis.core import RedisChannelLayer

from inference.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from inference.node.node import Node
from inference.protocol.delta_publisher import DeltaPublisher
from inference.protocol.keyed_messages import (
    RECORD_SUFFIX,
    KeyedRedisBroker,
    enqueue_keyed,
    forget_results,
    held_keys,
)
from inference.protocol.messages import (
    ABORT_ACTOR,
    CONTROLPLANE_QUEUE,
    GENERATE_ACTOR,
    RECORD_COMPLETION_ACTOR,
    RECORD_STARTED_ACTOR,
    control_queue,
    model_queue,
    results_of,
)

REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = "tiny"


@pytest.fixture
def broker():
    broker = KeyedRedisBroker(url=REDIS_URL, namespace=f"hearth-test-{uuid.uuid4().hex[:8]}")
    yield broker
    broker.flush_all()
    broker.close()


@pytest.fixture
def channel_layer():
    """A layer like production's (settings.CHANNEL_LAYERS): a channel holds up to 10,000
    messages. (At channels_redis's default of 100, the order test's 200 deltas overflowed the
    channel whenever the publisher ran ahead of the reader.)"""
    return RedisChannelLayer(
        hosts=[REDIS_URL], prefix=f"hearth-test-{uuid.uuid4().hex[:8]}", capacity=10_000
    )


def make_engine(model_dir, max_num_seqs=4) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir), dtype="float32", max_model_len=256, max_num_seqs=max_num_seqs
        )
    )


def enqueue(broker, body: dict, key: str | None = None) -> None:
    """A generation message for `body` on the model's queue (under `key`, as admission does)."""
    message = dramatiq.Message(
        queue_name=model_queue(MODEL),
        actor_name=GENERATE_ACTOR,
        args=(body,),
        kwargs={},
        options={},
    )
    if key:
        enqueue_keyed(broker, message, key)
    else:
        broker.enqueue(message)


def collect_results(broker, count: int, timeout_s: float = 60) -> dict[str, dict]:
    """The `record_completion` payloads of `count` requests; each must have been preceded by its
    `record_started` notice."""
    consumer = broker.consume(CONTROLPLANE_QUEUE, prefetch=count * 2, timeout=50)
    results: dict[str, dict] = {}
    started: set[str] = set()
    deadline = time.time() + timeout_s
    while len(results) < count and time.time() < deadline:
        message = next(consumer)
        if message is None:
            continue
        if message.actor_name == RECORD_STARTED_ACTOR:
            # The starts of a report window, in one notice.
            assert message.args[0]["node"]
            started.update(start["request_id"] for start in message.args[0]["starts"])
        else:
            assert message.actor_name == RECORD_COMPLETION_ACTOR
            for result in results_of(message.args[0]):  # a report window's results, together
                if not result.error:
                    assert result.request_id in started, "record_started must precede it"
                results[result.request_id] = result.as_message()
        consumer.ack(message)
    consumer.close()
    return results


def run_node(node: Node, broker, count: int) -> dict[str, dict]:
    """Run `node` in a thread until `count` results are in (collect_results); then stop it."""
    stop = threading.Event()
    thread = threading.Thread(target=node.run, args=(stop,), daemon=True)
    thread.start()
    try:
        return collect_results(broker, count)
    finally:
        stop.set()
        thread.join(timeout=30)


def request(request_id: str, prompt: list[int], **extra) -> dict:
    return {
        "request_id": request_id,
        "job_id": f"job_{request_id}",
        "org": "acme",
        "prompt_token_ids": prompt,
        "sampling": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
        "reply_channel": None,
        "deadline": None,
        "attempt": 1,
        **extra,
    }


def test_node_serves_requests_streams_deltas_and_reports_results(
    tiny_llama_dir, broker, channel_layer
):
    reply = async_to_sync(channel_layer.new_channel)()
    prompts = {"a": [3, 4, 5, 6], "b": list(range(10, 40)), "c": [7] * 20}
    for request_id, prompt in prompts.items():
        enqueue(
            broker, request(request_id, prompt, reply_channel=reply if request_id == "a" else None)
        )
    enqueue(broker, request("too-long", list(range(3, 300))))
    enqueue(broker, {"request_id": "bad", "prompt_token_ids": "nope", "job_id": "job_bad"})

    publisher = DeltaPublisher(channel_layer)
    beats: list[dict] = []
    node = Node(
        make_engine(tiny_llama_dir),
        MODEL,
        "node-1",
        broker,
        publisher,
        heartbeat=lambda key, state, ttl: beats.append(state),
    )
    try:
        results = run_node(node, broker, 5)
    finally:
        publisher.close()

    assert set(results) == {"a", "b", "c", "too-long", "bad"}
    expected = LLM(str(tiny_llama_dir), dtype="float32").generate(
        list(prompts.values()), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    for (request_id, prompt), want in zip(prompts.items(), expected, strict=True):
        result = results[request_id]
        assert result["token_ids"] == want.token_ids
        assert result["text"] == want.text
        assert result["finish_reason"] == "length" and result["error"] is None
        assert result["usage"] == {
            "prompt_tokens": len(prompt),
            "cached_tokens": 0,
            "completion_tokens": 8,
        }
        assert result["node"] == "node-1" and result["job_id"] == f"job_{request_id}"
        assert result["timings"]["ttft_s"] is not None
    assert "context length" in results["too-long"]["error"]
    assert "prompt_token_ids" in results["bad"]["error"]
    assert results["bad"]["job_id"] == "job_bad"

    deltas = []

    async def receive(channel: str) -> dict:
        return await asyncio.wait_for(channel_layer.receive(channel), timeout=10)

    while True:
        message = async_to_sync(receive)(reply)
        deltas.append(message)
        if message["type"] == "done":
            break
    assert "".join(d["text"] for d in deltas[:-1]) == results["a"]["text"]
    assert sum(len(d["token_ids"]) for d in deltas[:-1]) == 8
    assert beats and beats[0]["id"] == "node-1" and beats[0]["model"] == MODEL
    assert not node.inflight


def test_a_request_past_its_deadline_is_reported_expired_without_running(tiny_llama_dir, broker):
    enqueue(broker, request("late", [3, 4, 5], deadline=time.time() - 1))
    node = Node(make_engine(tiny_llama_dir), MODEL, "node-1", broker)
    deadline = time.time() + 10
    while not node.pull() and time.time() < deadline:
        pass
    assert not node.inflight and not node.engine.has_unfinished_requests()
    [result] = collect_results(broker, 1).values()
    assert result["error_code"] == "expired" and result["usage"]["prompt_tokens"] == 0


@pytest.mark.parametrize("n", [1, 2])
def test_an_abort_on_the_control_queue_stops_a_running_request(tiny_llama_dir, broker, n):
    long = request("long", [3, 4, 5])
    long["sampling"].update(max_tokens=200, n=n)
    enqueue(broker, long)
    node = Node(make_engine(tiny_llama_dir), MODEL, "node-1", broker)
    deadline = time.time() + 10
    while "long" not in node.inflight and time.time() < deadline:
        node.pull()
    node.step()  # a few tokens generated
    node.step()
    broker.enqueue(
        dramatiq.Message(
            queue_name=control_queue(MODEL, "node-1"),
            actor_name=ABORT_ACTOR,
            args=({"request_id": "long"},),
            kwargs={},
            options={},
        )
    )
    while node.inflight and time.time() < deadline:
        node.read_control(interval_s=0)
        node.step()
    assert not node.inflight
    [result] = collect_results(broker, 1).values()
    # Stopped, and reported with what it generated so far (the control plane bills that).
    assert result["finish_reason"] == "abort" and result["error"] is None
    assert 0 < result["usage"]["completion_tokens"] < 200 * n
    if n > 1:  # every choice stopped
        assert [c["finish_reason"] for c in result["choices"]] == ["abort"] * n
    assert not node.engine.has_unfinished_requests()


def test_work_waits_in_the_broker_until_a_node_has_room(tiny_llama_dir, broker):
    for index in range(3):
        enqueue(broker, request(f"r{index}", [3, 4, 5, index + 6]))
    busy = Node(make_engine(tiny_llama_dir, max_num_seqs=1), MODEL, "busy", broker)
    assert busy.pull() == 1
    assert busy.pull() == 0  # full: the other two stay in the broker
    other = Node(make_engine(tiny_llama_dir, max_num_seqs=4), MODEL, "other", broker)
    deadline = time.time() + 10
    while len(other.inflight) < 2 and time.time() < deadline:
        other.pull()
    assert len(other.inflight) == 2 and len(busy.inflight) == 1


def test_a_busy_node_asks_a_queue_it_found_empty_again_only_after_busy_poll_ms(
    tiny_llama_dir, broker
):
    """A busy node does not fetch from an empty queue at every step; an idle one always asks."""
    long = request("long", [3, 4, 5])
    long["sampling"].update(max_tokens=200)
    enqueue(broker, long)
    node = Node(make_engine(tiny_llama_dir), MODEL, "node-1", broker, busy_poll_ms=60_000)
    deadline = time.time() + 10
    while "long" not in node.inflight and time.time() < deadline:
        node.pull()
    assert node.pull() == 0  # busy, and both queues found empty now
    enqueue(broker, request("next", [3, 4, 6]))
    node.step()
    assert node.pull() == 0 and "next" not in node.inflight  # not asked again yet
    node.busy_poll_s = 0  # the interval has passed
    while "next" not in node.inflight and time.time() < deadline:
        node.pull()
    assert "next" in node.inflight

    idle = Node(make_engine(tiny_llama_dir), MODEL, "node-2", broker, busy_poll_ms=60_000)
    assert idle.pull() == 0  # found empty, but idle: the next pull asks again
    enqueue(broker, request("idle", [3, 4, 7]))
    while "idle" not in idle.inflight and time.time() < deadline:
        idle.pull()
    assert "idle" in idle.inflight


def test_node_process_serves_heartbeats_and_stops_on_sigterm(tiny_llama_dir, broker):
    import json
    import signal
    import subprocess
    import sys

    import redis

    node_id = f"proc-{uuid.uuid4().hex[:6]}"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inference.node",
            "--model",
            MODEL,
            "--source",
            str(tiny_llama_dir),
            "--node-id",
            node_id,
            "--redis-url",
            REDIS_URL,
            "--broker-namespace",
            broker.namespace,
            "--dtype",
            "float32",
            "--kv-cache-mb",
            "16",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        enqueue(broker, request("p1", [3, 4, 5, 6]))
        results = collect_results(broker, 1, timeout_s=120)
        assert results["p1"]["node"] == node_id and results["p1"]["usage"]["completion_tokens"] == 8
        client = redis.Redis.from_url(REDIS_URL)
        state = json.loads(client.get(f"hearth:node:{node_id}"))
        assert state["model"] == MODEL and state["id"] == node_id
        assert 63 <= state["free_slots"] <= 64  # a beat may fall while p1 runs
        assert 0 < client.pttl(f"hearth:node:{node_id}") <= 6000
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output


def test_deltas_to_one_channel_arrive_in_the_order_sent(channel_layer):
    """Each send is its own task on the publisher's loop; Redis round trips must not let a
    later delta overtake an earlier one (found by the production-stack test)."""
    publisher = DeltaPublisher(channel_layer)
    channel = async_to_sync(channel_layer.new_channel)()
    try:
        for index in range(200):
            publisher.send(channel, {"type": "delta", "index": index})

        async def receive_all() -> list[int]:
            return [
                (await asyncio.wait_for(channel_layer.receive(channel), timeout=10))["index"]
                for _ in range(200)
            ]

        assert async_to_sync(receive_all)() == list(range(200))
    finally:
        publisher.close()


def test_n_choices_run_as_sequences_of_their_own_and_report_together(tiny_llama_dir, broker):
    sampled = {"temperature": 1.0, "max_tokens": 6, "ignore_eos": True, "seed": 5, "n": 3}
    enqueue(broker, request("several", [3, 4, 5, 6], sampling=sampled))
    greedy = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "n": 2}
    enqueue(broker, request("twice", [3, 4, 5, 6], sampling=greedy))
    enqueue(broker, request("too-many", [3, 4], sampling={"max_tokens": 2, "n": 9}))
    node = Node(make_engine(tiny_llama_dir, max_num_seqs=8), MODEL, "node-1", broker)
    results = run_node(node, broker, 3)

    several = results["several"]
    assert [len(c["token_ids"]) for c in several["choices"]] == [6, 6, 6]
    assert several["usage"]["completion_tokens"] == 18 and several["usage"]["prompt_tokens"] == 4
    assert several["text"] == several["choices"][0]["text"]
    # Each choice draws with seed + index: choice i equals a lone request seeded 5 + i.
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    for index, choice in enumerate(several["choices"]):
        alone = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=5 + index)
        assert choice["token_ids"] == llm.generate([[3, 4, 5, 6]], alone)[0].token_ids
    twice = results["twice"]["choices"]
    assert twice[0]["token_ids"] == twice[1]["token_ids"]
    assert results["too-many"]["error"] and "n must be" in results["too-many"]["error"]
    assert not node.inflight and not node.sequences


def test_a_nul_in_generated_text_reaches_the_control_plane_as_a_replacement_character(
    tiny_llama_dir, broker
):
    """PostgreSQL's jsonb cannot hold U+0000: a result with one could never be recorded."""
    tokenizer = make_engine(tiny_llama_dir).tokenizer
    nul = next(i for i in range(tokenizer.vocab_size) if "\x00" in tokenizer.decode([i]))
    sampling = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True, "logprobs": True}
    sampling["logit_bias"] = {str(nul): 100}
    enqueue(broker, request("nul", [3, 4, 5], sampling=sampling))
    node = Node(make_engine(tiny_llama_dir), MODEL, "node-1", broker)
    [result] = run_node(node, broker, 1).values()
    assert result["token_ids"] == [nul] * 3
    assert result["text"] == "\ufffd" * 3
    assert [e["token"] for e in result["logprobs"]] == ["\ufffd"] * 3


def test_a_running_request_the_broker_hands_back_keeps_its_message_until_it_finishes(
    tiny_llama_dir, broker
):
    """The broker requeues the un-acked messages of a consumer it takes for dead; the node that
    gets its own running request back must not ack that copy: the ack would drop the running
    request's message (same key), and the sweep would take the job for lost and run it again."""
    body = request("again", [3, 4, 5], attempt=1)
    body["sampling"]["max_tokens"] = 40
    enqueue(broker, body, "again.1")
    node = Node(make_engine(tiny_llama_dir), MODEL, "node-1", broker)
    deadline = time.time() + 10
    while "again" not in node.inflight and time.time() < deadline:
        node.pull()
    node.step()
    broker.do_requeue(model_queue(MODEL), "again.1")  # what the broker's maintenance does
    while node.pull() == 0 and time.time() < deadline:
        pass  # the copy comes back, and is taken as one more message
    assert list(node.inflight) == ["again"] and node.engine.num_running == 1
    assert held_keys(broker, [(model_queue(MODEL), "again.1")]) == [True]
    results = run_node(node, broker, 1)
    assert results["again"]["usage"]["completion_tokens"] == 40
    assert held_keys(broker, [(model_queue(MODEL), "again.1")]) == [False]  # the run's ack


def test_a_copy_under_a_new_key_of_a_running_request_is_acked_and_dropped(tiny_llama_dir, broker):
    body = request("twice", [3, 4, 5])
    body["sampling"]["max_tokens"] = 40
    for key in ("twice.1", "twice.2"):  # the second: the sweep's dispatch under a new key
        enqueue(broker, body, key)
    node = Node(make_engine(tiny_llama_dir), MODEL, "node-1", broker)
    deadline, taken = time.time() + 10, 0
    while taken < 2 and time.time() < deadline:
        taken += node.pull()
    assert list(node.inflight) == ["twice"] and node.engine.num_waiting == 1  # one sequence
    held = held_keys(broker, [(model_queue(MODEL), "twice.1"), (model_queue(MODEL), "twice.2")])
    assert held == [True, False]


def test_the_results_of_one_report_window_travel_in_one_message_held_under_each_answered_key(
    tiny_llama_dir, broker
):
    """Three requests that finish within one report window: one `record_completion` message
    carries their results, the broker counts each answered job's result as held (the sweep's
    question) while it waits, and their three messages are acked."""
    keys = {name: f"{name}.1" for name in ("x", "y", "z")}
    for name, key in keys.items():
        enqueue(broker, request(name, [3, 4, 5, 6]), key)
    node = Node(make_engine(tiny_llama_dir), MODEL, "node-1", broker)
    deadline = time.time() + 30
    while len(node.inflight) < 3 and time.time() < deadline:
        node.pull()
    while node.inflight and time.time() < deadline:
        node.step()
    generation = [(model_queue(MODEL), key) for key in keys.values()]
    recorded = [(CONTROLPLANE_QUEUE, key + RECORD_SUFFIX) for key in keys.values()]
    assert held_keys(broker, generation) == [False] * 3  # acked, together
    assert held_keys(broker, recorded) == [True] * 3
    consumer = broker.consume(CONTROLPLANE_QUEUE, prefetch=10, timeout=200)
    messages = []
    while (message := next(consumer)) is not None:
        messages.append(message)
    [results] = [m for m in messages if m.actor_name == RECORD_COMPLETION_ACTOR]
    body = results.args[0]
    assert body["node"] == "node-1" and sorted(body["answered"]) == sorted(keys.values())
    assert [r.request_id for r in results_of(body)] == ["x", "y", "z"]
    assert all(r.usage.completion_tokens == 8 for r in results_of(body))
    assert held_keys(broker, recorded) == [True] * 3  # taken by a worker, not yet acked
    for message in messages:
        consumer.ack(message)
    assert held_keys(broker, recorded) == [False] * 3  # the message is gone: so are the results
    forget_results(broker, body["answered"])
    assert not broker.client.exists(f"{broker.namespace}:results-of")
    consumer.close()


def test_a_draining_node_finishes_what_it_runs_gives_back_what_it_fetched_and_returns(
    tiny_llama_dir, broker
):
    """`drain()`: the requests the engine holds run to the end and are reported; the messages the
    Redis consumer had fetched beyond them go back to the queue at once (not after the broker's
    heartbeat timeout), where another node takes them; the node leaves the registry."""
    sampling = {"temperature": 0.0, "max_tokens": 30, "ignore_eos": True, "n": 2}
    for index in range(4):
        enqueue(broker, request(f"r{index}", [3, 4, 5 + index], sampling=sampling))
    beats: list[dict | None] = []
    node = Node(
        make_engine(tiny_llama_dir, max_num_seqs=4),
        MODEL,
        "node-1",
        broker,
        heartbeat=lambda node_id, state, ttl: beats.append(state),
    )
    deadline = time.time() + 10
    while len(node.inflight) < 2 and time.time() < deadline:
        node.pull()
    # Two requests of two choices fill the engine; one fetch took all four messages.
    assert sorted(node.inflight) == ["r0", "r1"]
    queue = f"{broker.namespace}:{model_queue(MODEL)}"
    assert broker.client.llen(queue) == 0

    node.drain()
    thread = threading.Thread(target=node.run, args=(threading.Event(),), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()  # it returned by itself
    assert broker.client.llen(queue) == 2  # r2 and r3, given back
    assert beats and all(state is None for state in beats)  # out of the registry throughout
    results = collect_results(broker, 2)
    assert sorted(results) == ["r0", "r1"]
    assert all(r["usage"]["completion_tokens"] == 60 for r in results.values())

    successor = Node(make_engine(tiny_llama_dir, max_num_seqs=4), MODEL, "node-2", broker)
    assert sorted(run_node(successor, broker, 2)) == ["r2", "r3"]

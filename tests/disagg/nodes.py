"""A decode node and a prefill node of a tiny model in threads of the test's process, each with
its own engine and Transfer Engine, over the real Redis broker."""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager

import dramatiq

from inference.disagg.layout import kv_layout_of
from inference.disagg.prefill_node import PrefillNode
from inference.disagg.transfer import KVTransfer
from inference.engine import EngineConfig, LLMEngine
from inference.node.node import Node
from inference.protocol.keyed_messages import KeyedRedisBroker
from inference.protocol.messages import (
    CONTROLPLANE_QUEUE,
    GENERATE_ACTOR,
    RECORD_COMPLETION_ACTOR,
    model_queue,
    prefill_node_queue,
    results_of,
)

REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = "tiny"


def make_broker() -> KeyedRedisBroker:
    return KeyedRedisBroker(url=REDIS_URL, namespace=f"hearth-test-{uuid.uuid4().hex[:8]}")


def make_engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(
        model=str(model_dir), dtype="float32", max_model_len=512, num_kv_blocks=96, max_num_seqs=8
    )
    return LLMEngine(EngineConfig(**{**settings, **overrides}))


def decode_node(model_dir, broker, node_id="decode-1", publisher=None, **engine) -> Node:
    engine = make_engine(model_dir, **engine)
    transfer = KVTransfer(engine.runner.kv_buffer, kv_layout_of(engine, MODEL))
    return Node(engine, MODEL, node_id, broker, publisher, role="decode", kv=transfer)


def prefill_node(model_dir, broker, node_id="prefill-1", **engine) -> PrefillNode:
    engine = make_engine(model_dir, **engine)
    transfer = KVTransfer(engine.runner.kv_buffer, kv_layout_of(engine, MODEL))
    return PrefillNode(engine, MODEL, node_id, broker, transfer)


def request(request_id: str, prompt: list[int], prefill_to: str | None = "prefill-1", **extra):
    """A generation message split to `prefill_to`'s own queue (None: not split)."""
    body = {
        "request_id": request_id,
        "job_id": f"job_{request_id}",
        "org": "acme",
        "prompt_token_ids": prompt,
        "sampling": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
        "reply_channel": None,
        "deadline": None,
        "attempt": 1,
    }
    if prefill_to is not None:
        body["prefill"] = {"queue": prefill_node_queue(MODEL, prefill_to)}
    body.update(extra)
    return body


def enqueue(broker, body: dict) -> None:
    broker.enqueue(
        dramatiq.Message(
            queue_name=model_queue(MODEL),
            actor_name=GENERATE_ACTOR,
            args=(body,),
            kwargs={},
            options={},
        )
    )


def collect_results(broker, count: int, timeout_s: float = 60) -> dict[str, dict]:
    """The results of `count` requests, by request id."""
    consumer = broker.consume(CONTROLPLANE_QUEUE, prefetch=count * 2, timeout=50)
    results: dict[str, dict] = {}
    deadline = time.time() + timeout_s
    try:
        while len(results) < count and time.time() < deadline:
            message = next(consumer)
            if message is None:
                continue
            if message.actor_name == RECORD_COMPLETION_ACTOR:
                for result in results_of(message.args[0]):
                    results[result.request_id] = result.as_message()
            consumer.ack(message)
    finally:
        consumer.close()
    return results


@contextmanager
def running(*nodes):
    """Run `nodes` in threads; stop them on exit."""
    stop = threading.Event()
    threads = [threading.Thread(target=n.run, args=(stop,), daemon=True) for n in nodes]
    for thread in threads:
        thread.start()
    try:
        yield stop
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)

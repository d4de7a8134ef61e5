"""What every node's heartbeat says about its engine (docs/architecture.md: load, cache, layout)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import dramatiq

from inference.engine.llm_engine import LLMEngine
from inference.protocol.heartbeat import DIGEST_MAX_BLOCKS, encode_prefix_digest


def engine_state(
    node_id: str, model: str, role: str, engine: LLMEngine, free_slots: int, **extra: Any
) -> dict[str, Any]:
    """A heartbeat state: the engine's load and prefix-cache digest, plus `extra` fields (the
    KV layout, the disaggregation counters, …)."""
    stats = engine.stats()
    return {
        "id": node_id,
        "model": model,
        "role": role,
        "free_blocks": stats.num_free_blocks,
        "num_blocks": stats.num_blocks,
        "block_size": stats.block_size,
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "free_slots": free_slots,
        "max_num_seqs": engine.config.max_num_seqs,
        "awaiting_kv": stats.num_awaiting_kv,
        "held_blocks": stats.num_held_blocks,
        **({"expert_tokens": stats.expert_tokens} if stats.expert_tokens is not None else {}),
        **extra,
        "cached_prefix_digest": encode_prefix_digest(engine.cached_block_hashes(DIGEST_MAX_BLOCKS)),
        "at": time.time(),
    }


class Heartbeats:
    """A node's heartbeats to its sink (`HeartbeatSink`: node id, state, TTL), at most every
    `interval_s` unless forced, each living three intervals. A state of None says the node is
    alive but takes no work (draining); `leave` takes it out of the registry at once."""

    def __init__(self, sink, node_id: str, interval_s: float) -> None:
        self.sink = sink
        self.node_id = node_id
        self.interval_s = interval_s
        self._last = 0.0

    def beat(self, state: Callable[[], dict[str, Any] | None], force: bool = False) -> None:
        """Send `state()` if a beat is due (it is only built then)."""
        now = time.monotonic()
        if self.sink is None or (not force and now - self._last < self.interval_s):
            return
        self._last = now
        self.sink(self.node_id, state(), self.interval_s * 3)

    def leave(self) -> None:
        if self.sink is not None:
            self.sink(self.node_id, None, 0)


class QueueSender:
    """Sends one-argument messages to queues another node consumes, declaring each queue the
    first time (embedded mode's in-process broker refuses a queue it was not told of)."""

    def __init__(self, broker) -> None:
        self.broker = broker
        self._declared: set[str] = set()

    def send(self, queue: str, actor_name: str, body: dict[str, Any]) -> None:
        if queue not in self._declared:
            self.broker.declare_queue(queue)
            self._declared.add(queue)
        self.broker.enqueue(
            dramatiq.Message(
                queue_name=queue, actor_name=actor_name, args=(body,), kwargs={}, options={}
            )
        )

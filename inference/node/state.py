"""What every node's heartbeat says about its engine (docs/architecture.md: load, cache, layout)."""

from __future__ import annotations

import time
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
        **extra,
        "cached_prefix_digest": encode_prefix_digest(engine.cached_block_hashes(DIGEST_MAX_BLOCKS)),
        "at": time.time(),
    }


class QueueSender:
    """Sends one-argument messages to queues another node consumes, declaring each queue the
    first time (the stub broker of embedded mode refuses an undeclared one)."""

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

"""A decode node's side of disaggregated prefill: ask the prefill pool for the KV of the requests
that await it, and apply the answers.

The engine decides (Scheduler): it admits a request that the gateway split only when the blocks of
its whole prompt and its `max_tokens` reserve are free, allocates them, and reports each attempt
(`take_kv_requests`) under a new epoch. The first attempt goes to the prefill queue the gateway
chose (prefix-aware); a retry, after `kv_wait_s` without an answer, to the shared prefill queue,
so that another prefill node takes it if the first one died. A `prefill_done` for an earlier
epoch, or for a request that no longer awaits, changes nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from inference.disagg.transfer import GroupTransfer, KVTransfer
from inference.engine.llm_engine import LLMEngine
from inference.node.state import QueueSender
from inference.protocol.disagg import PrefillDone, PrefillRequest, disagg_counters
from inference.protocol.messages import PREFILL_ACTOR, control_queue, prefill_queue

logger = logging.getLogger(__name__)


class RemotePrefills:
    """What a decode node asked of the prefill pool, and what came back."""

    def __init__(
        self,
        engine: LLMEngine,
        transfer: KVTransfer | GroupTransfer,
        broker,
        model: str,
        node_id: str,
    ) -> None:
        self.engine = engine
        self.transfer = transfer
        self.broker = broker
        self.model = model
        self.node_id = node_id
        self.reply_queue = control_queue(model, node_id)
        self.counters = disagg_counters()
        self._first_queue: dict[str, str] = {}  # sequence id → the gateway's prefill queue
        self.filled_by: dict[str, str] = {}  # sequence id → the prefill node that filled it
        self.sender = QueueSender(broker)

    def expect(self, sequence_id: str, queue: str) -> None:
        """`sequence_id` was added with remote_prefill; its first attempt goes to `queue`."""
        self._first_queue[sequence_id] = queue

    def forget(self, sequence_id: str) -> str | None:
        """The request finished; returns the prefill node that filled it, if one did."""
        self._first_queue.pop(sequence_id, None)
        return self.filled_by.pop(sequence_id, None)

    @property
    def awaiting(self) -> int:
        return len(self.engine.scheduler.awaiting_kv)

    def send_requests(self) -> int:
        """A prefill message for every attempt the engine started since the last call."""
        sent = 0
        for request in self.engine.take_kv_requests():
            first = self._first_queue.get(request.request_id)
            queue = first if request.epoch == 1 and first else prefill_queue(self.model)
            seq = self.engine.sequences[request.request_id]
            body = PrefillRequest(
                request_id=request.request_id,
                epoch=request.epoch,
                org=seq.namespace,
                token_ids=request.token_ids,
                first_block=request.first_block,
                block_ids=request.block_ids,
                deadline=request.deadline,
                reply_queue=self.reply_queue,
                decode_node=self.node_id,
                kv=self.transfer.region.as_dict(),
            ).as_message()
            self.sender.send(queue, PREFILL_ACTOR, body)
            self.counters["requests"] += 1
            self.counters["blocks_reused"] += request.first_block
            sent += 1
        return sent

    def on_done(self, body: dict[str, Any]) -> bool:
        """Apply a `prefill_done`; True when it let a request run on (or fall back at once)."""
        try:
            done = PrefillDone.from_message(body)
        except TypeError:
            logger.warning("dropped a malformed prefill_done: %r", body)
            return False
        if done.error is not None:
            if self.engine.kv_failed(done.request_id, done.epoch):
                logger.warning(
                    "prefill node %s refused %s (%s); prefilling it here",
                    done.prefill_node,
                    done.request_id,
                    done.error,
                )
                return True
            return False
        if not self.engine.kv_arrived(done.request_id, done.epoch, done.cached_tokens):
            logger.info("stale prefill_done for %s (epoch %d)", done.request_id, done.epoch)
            return False
        self.filled_by[done.request_id] = done.prefill_node
        self.counters["tokens_transferred"] += done.tokens
        self.counters["blocks_transferred"] += done.blocks
        self.counters["bytes_transferred"] += done.bytes
        self.counters["transfer_seconds"] += done.transfer_s
        return True

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "fallbacks": self.engine.scheduler.num_kv_fallbacks}

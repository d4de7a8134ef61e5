"""A prefill node: computes prompts' KV for decode nodes and writes it into their caches.

It pulls `prefill` messages (inference/protocol/disagg.py) from its own queue first (the gateway
routed the prompt's prefix here), then from the pool's shared queue, only while its engine has a
sequence slot and nothing waiting for blocks, so that work it cannot start stays in the broker for
another prefill node. Each prompt runs prefill-only (its prefix cache serves and keeps what it
can; nothing is sampled, streamed or billed here); once computed, its blocks are written into the
decode node's, unless the attempt's deadline has passed (the decode node has moved on and holds
those blocks only until then), and `prefill_done` goes to the decode node's control queue. The
message is acked after that answer is enqueued: a node killed before leaves it to be redelivered
(and then refused as late, or done again under the same epoch into blocks still held for it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from dramatiq.broker import Broker, Consumer, MessageProxy

from inference.disagg.layout import KVPeers, KVRegion, LayoutMismatchError
from inference.disagg.transfer import GroupTransfer, KVTransfer, TransferError
from inference.engine.llm_engine import LLMEngine
from inference.engine.sampling_params import SamplingParams
from inference.errors import InvalidRequestError
from inference.node.metrics import NodeMetrics
from inference.node.node import BROKER_DOWN
from inference.node.state import Heartbeats, QueueSender, engine_state
from inference.protocol.disagg import PrefillDone, PrefillRequest, disagg_counters
from inference.protocol.logs import bind_log_context
from inference.protocol.messages import PREFILL_DONE_ACTOR, prefill_node_queue, prefill_queue

logger = logging.getLogger(__name__)
BROKER_RETRY_S = 0.5


@dataclass
class _Prefill:
    request: PrefillRequest
    peer: KVRegion
    consumer: Consumer
    message: MessageProxy


class PrefillNode:
    """One engine computing prompts for the decode nodes of one model."""

    def __init__(
        self,
        engine: LLMEngine,
        model: str,
        node_id: str,
        broker: Broker,
        transfer: KVTransfer | GroupTransfer,
        heartbeat=None,
        poll_ms: int = 4,
        heartbeat_interval_s: float = 2.0,
        metrics: NodeMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.model = model
        self.node_id = node_id
        self.broker = broker
        self.transfer = transfer
        self.heartbeats = Heartbeats(heartbeat, node_id, heartbeat_interval_s)
        self.metrics = (metrics or NodeMetrics()).node(model, node_id)  # inference/node/metrics.py
        self.peers = KVPeers(transfer.region.layout)
        self.counters = disagg_counters()
        self.prefills: dict[str, _Prefill] = {}  # engine sequence id → its message
        queues = [prefill_node_queue(model, node_id), prefill_queue(model)]
        for name in queues:
            broker.declare_queue(name)
        self.poll_ms = poll_ms
        prefetch = engine.config.max_num_seqs
        self.consumers = [broker.consume(q, prefetch=prefetch, timeout=poll_ms) for q in queues]
        self.sender = QueueSender(broker)
        self.draining = False

    # ---- admission ------------------------------------------------------------------------
    def free_slots(self) -> int:
        """Prompts it can take now: none while one waits for blocks (the rest stay in the
        broker, for a prefill node that has them), else its free sequence slots."""
        if self.engine.num_waiting:
            return 0
        return max(0, self.engine.config.max_num_seqs - self.engine.num_running)

    def pull(self) -> int:
        taken = 0
        busy = self.engine.has_unfinished_requests()
        for consumer in self.consumers:
            consumer.timeout = 0 if busy else max(1, self.poll_ms // len(self.consumers))
            while self.free_slots() > 0:
                outstanding = sum(1 for p in self.prefills.values() if p.consumer is consumer)
                consumer.prefetch = outstanding + self.free_slots()
                message = next(consumer)
                if message is None:
                    break
                self._admit(consumer, message)
                taken += 1
        return taken

    def _admit(self, consumer: Consumer, message: MessageProxy) -> None:
        body = message.args[0] if message.args else None
        try:
            request = PrefillRequest.from_message(body)
            peer = KVRegion.from_dict(request.kv)
        except (KeyError, TypeError, ValueError, AttributeError):
            logger.warning("dropped a malformed prefill message %s", message.message_id)
            consumer.ack(message)
            return
        if request.deadline <= time.time():
            # Redelivered late (its node died), or it waited too long: the decode node has
            # already asked again or prefilled it itself.
            logger.info("late prefill of %s (epoch %d)", request.request_id, request.epoch)
            consumer.ack(message)
            return
        engine_id = message.message_id
        if engine_id in self.prefills:
            return  # the same message again, while this node runs it
        try:
            self.peers.check(peer)
            self.engine.add_request(
                engine_id,
                request.token_ids,
                SamplingParams(max_tokens=1),
                namespace=request.org,
                prefill_only=True,
            )
        except (LayoutMismatchError, InvalidRequestError) as error:
            logger.error("refused the prefill of %s: %s", request.request_id, error)
            self._answer(request, error=str(error))
            consumer.ack(message)
            return
        self.prefills[engine_id] = _Prefill(request, peer, consumer, message)
        logger.info(
            "prefilling %s (epoch %d, %d tokens) for %s",
            request.request_id,
            request.epoch,
            len(request.token_ids),
            request.decode_node,
        )

    # ---- running ----------------------------------------------------------------------------
    def step(self) -> None:
        for output in self.metrics.timed_step(self.engine):
            prefill = self.prefills.pop(output.request_id, None)
            if prefill is None:
                continue
            if output.finish_reason == "prefilled":
                try:
                    self._send(prefill, output.request_id, output.cached_tokens)
                finally:
                    self.engine.release_prefilled(output.request_id)
            else:
                self._answer(prefill.request, error=f"prefill ended: {output.finish_reason}")
            prefill.consumer.ack(prefill.message)

    def _send(self, prefill: _Prefill, engine_id: str, cached_tokens: int) -> None:
        """Write the computed blocks into the decode node's, then say so."""
        request = prefill.request
        blocks = self.engine.prefilled_blocks(engine_id)[request.first_block :]
        if len(blocks) != len(request.block_ids):
            asked = len(request.block_ids)
            self._answer(request, error=f"{len(blocks)} blocks computed, {asked} asked")
            return
        if time.time() >= request.deadline:
            logger.info("too late to write %s (epoch %d)", request.request_id, request.epoch)
            return
        block_size = self.engine.config.block_size
        tokens = len(request.token_ids) - request.first_block * block_size
        try:
            written = self.transfer.write_blocks(
                prefill.peer, blocks, request.block_ids, tokens - (len(blocks) - 1) * block_size
            )
        except TransferError as error:
            logger.warning("could not write the KV of %s: %s", request.request_id, error)
            self._answer(request, error=str(error))
            return
        counters = self.counters
        counters["requests"] += 1
        counters["tokens_prefilled"] += len(request.token_ids) - cached_tokens
        counters["tokens_transferred"] += tokens
        counters["blocks_transferred"] += written.blocks
        counters["bytes_transferred"] += written.bytes
        counters["transfer_seconds"] += written.seconds
        counters["blocks_reused"] += request.first_block
        self._answer(
            request,
            cached_tokens=cached_tokens,
            tokens=tokens,
            blocks=written.blocks,
            bytes=written.bytes,
            transfer_s=written.seconds,
        )

    def _answer(self, request: PrefillRequest, **fields: Any) -> None:
        done = PrefillDone(request.request_id, request.epoch, self.node_id, **fields)
        self.sender.send(request.reply_queue, PREFILL_DONE_ACTOR, done.as_message())

    # ---- state ------------------------------------------------------------------------------
    def queued_tokens(self) -> int:
        """Prompt tokens taken and not computed yet: the load the gateway balances on."""
        return sum(
            seq.num_tokens - seq.num_computed_tokens
            for seq in self.engine.sequences.values()
            if not seq.is_finished
        )

    def beat(self, force: bool = False) -> None:
        self.heartbeats.beat(self._state, force)

    def _state(self) -> dict[str, Any] | None:
        self.metrics.engine_stats(self.engine.stats())
        if self.draining:
            return None
        return engine_state(
            self.node_id,
            self.model,
            "prefill",
            self.engine,
            self.free_slots(),
            queued_tokens=self.queued_tokens(),
            kv_layout=self.transfer.region.layout.as_dict(),
            kv_endpoint=self.transfer.region.endpoint,
            kv_ranks=self.transfer.region.as_dict()["ranks"],  # every rank's, in a group
            disagg=dict(self.counters),
        )

    def drain(self) -> None:
        """Take nothing more; `run` returns once what it holds is written and answered."""
        self.draining = True

    def run(self, stop: threading.Event) -> None:
        """Serve until `stop`, or after `drain()` until every prompt taken is answered. At
        `stop`, what is unanswered stays unacked: the broker redelivers it."""
        bind_log_context(node=self.node_id)
        self.beat(force=True)
        while not stop.is_set():
            try:
                if not self.draining:
                    self.pull()
                elif not self.prefills:
                    break
                if self.engine.has_unfinished_requests():
                    self.step()
                self.beat()
            except BROKER_DOWN as error:
                logger.warning("broker unavailable (%s); retrying", error)
                stop.wait(BROKER_RETRY_S)
        for consumer in self.consumers:
            consumer.close()
        with contextlib.suppress(*BROKER_DOWN):
            self.heartbeats.leave()

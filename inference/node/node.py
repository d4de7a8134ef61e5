"""The node loop: pull work while the engine has room, step, stream, report, heartbeat.

Work waits in the broker, not in the node: a message is taken only while the engine's running
and waiting requests stay below its `max_num_seqs`, so another node with room can take the
rest. A message is acked only after its `record_completion` is enqueued, so a node that dies
mid-request leaves it to be redelivered (at least once); the control plane makes the effects
exactly once. Results and start notices are reported in groups: what finished (or started)
within `report_ms` goes in one message, and the answered messages are acked in one round trip;
an engine that runs out of work reports at once, so a lone request waits for nothing.

A decode node (`role="decode"`, with a KVTransfer) has the prompts of the requests the gateway
split computed by a prefill node (inference/disagg/decode.py); every other node prefills them
itself. The KV of a request with n > 1 choices is asked for once: its other choices start when the
first one has its first token, and find the prompt in the prefix cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import redis
from dramatiq.broker import Broker, Consumer, MessageProxy
from dramatiq.errors import BrokerConnectionError

from inference.disagg.decode import RemotePrefills
from inference.disagg.layout import kv_layout_of
from inference.disagg.transfer import GroupTransfer, KVTransfer
from inference.engine.llm_engine import LLMEngine
from inference.engine.outputs import RequestOutput, Timings
from inference.engine.sampling_params import SamplingParams
from inference.errors import InvalidRequestError, RequestExpiredError
from inference.node.metrics import NodeMetrics
from inference.node.state import Heartbeats, engine_state
from inference.protocol.delta_publisher import DeltaPublisher
from inference.protocol.disagg import disagg_counters
from inference.protocol.keyed_messages import (
    RECORD_SUFFIX,
    ack_all,
    enqueue_keyed,
    enqueue_results,
    message_key,
)
from inference.protocol.logs import bind_log_context, log_context
from inference.protocol.messages import (
    ABORT_ACTOR,
    CONTROLPLANE_QUEUE,
    PREFILL_DONE_ACTOR,
    RECORD_COMPLETION_ACTOR,
    RECORD_STARTED_ACTOR,
    GenerationRequest,
    completion_payload,
    control_queue,
    logprob_entries,
    model_queue,
    node_queue,
    storable_text,
)

logger = logging.getLogger(__name__)
BROKER_RETRY_S = 0.5
DRAIN_POLL_S = 1.0
# What a broker that went away raises: Dramatiq's consumers wrap redis-py's error, enqueues do not.
BROKER_DOWN = (BrokerConnectionError, redis.ConnectionError, redis.TimeoutError)


@dataclass
class _Choice:
    """One of a request's `n` completions: an engine sequence of its own."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None  # set when it finished


@dataclass
class _InFlight:
    request: GenerationRequest
    consumer: Consumer
    message: MessageProxy
    choices: list[_Choice] = field(default_factory=list)
    output: RequestOutput | None = None  # the first choice's last output: usage and timings
    # Choices added once the first has its first token (its prompt's KV came from a prefill
    # node): (engine sequence id, their sampling parameters).
    deferred: list[tuple[str, SamplingParams]] = field(default_factory=list)
    prefill_node: str | None = None  # the prefill node that computed the prompt


def sequence_id(request_id: str, index: int, n: int) -> str:
    """The engine's id of a request's `index`-th choice (the request's own id when n is 1)."""
    return request_id if n == 1 else f"{request_id}/{index}"


# (node id, state, TTL in seconds): the node's state for the registry, or None for a node that is
# alive but takes no work (draining, or gone): out of the registry, its last beat still recorded.
HeartbeatSink = Callable[[str, dict[str, Any] | None, float], None]


class Node:
    """One engine serving one model, fed by the broker."""

    def __init__(
        self,
        engine: LLMEngine,
        model: str,
        node_id: str,
        broker: Broker,
        publisher: DeltaPublisher | None = None,
        heartbeat: HeartbeatSink | None = None,
        role: str = "unified",
        kv: KVTransfer | GroupTransfer | None = None,
        poll_ms: int = 4,
        busy_poll_ms: int = 20,
        report_ms: int = 50,
        heartbeat_interval_s: float = 2.0,
        metrics: NodeMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.model = model
        self.node_id = node_id
        self.broker = broker
        self.publisher = publisher
        self.role = role
        self.kv_layout = kv_layout_of(engine, model).as_dict()
        # Only a decode node asks prefill nodes for KV; a unified one prefills what it takes.
        self.remote = (
            RemotePrefills(engine, kv, broker, model, node_id)
            if kv is not None and role == "decode"
            else None
        )
        self.heartbeats = Heartbeats(heartbeat, node_id, heartbeat_interval_s)
        # Recorded whether or not anything serves them (`metrics`: the process's, if it does).
        self.metrics = (metrics or NodeMetrics()).node(model, node_id)
        self.inflight: dict[str, _InFlight] = {}
        self._full_until_step = False
        # Engine sequence id → its request and choice index (sequence_id).
        self.sequences: dict[str, tuple[_InFlight, int]] = {}
        self.finished: list[tuple[dict[str, Any], _InFlight]] = []  # record_finished
        self.unrecorded: list[tuple[dict[str, Any], _InFlight]] = []
        self.unsent_starts: list[dict[str, Any]] = []  # send_starts
        self.report_s = report_ms / 1000
        self._finished_since = self._starts_since = 0.0  # when the oldest unsent one came
        self.recorded_late = 0
        # The node's own queue first: affinity traffic must not wait behind the shared queue.
        queues = [node_queue(model, node_id), model_queue(model)]
        for name in [*queues, CONTROLPLANE_QUEUE]:
            broker.declare_queue(name)
        prefetch = engine.config.max_num_seqs
        self.poll_ms = poll_ms
        self.busy_poll_s = busy_poll_ms / 1000
        self.consumers = [broker.consume(q, prefetch=prefetch, timeout=poll_ms) for q in queues]
        self._found_empty = [0.0 for _ in queues]  # when each consumer last came back empty
        broker.declare_queue(control_queue(model, node_id))
        self.control = broker.consume(control_queue(model, node_id), prefetch=16, timeout=0)
        self._last_control = 0.0
        self.draining = False  # drain(): take nothing more, finish what runs, then return
        self._drain_started = False
        self._gave_back_at = 0.0

    # ---- admission ------------------------------------------------------------------------
    def free_slots(self) -> int:
        """Requests the engine can take now: sequence slots not held by running, waiting or
        KV-awaiting ones. None, until its next step, on a decode node that gave back a split
        request for want of blocks (`_admit`)."""
        if self._full_until_step:
            return 0
        held = self.engine.num_running + self.engine.num_waiting + self.engine.num_awaiting_kv
        return max(0, self.engine.config.max_num_seqs - held)

    def pull(self) -> int:
        """Take as many messages as the engine can admit; returns how many were taken.

        While the engine has work, an empty queue must not hold up its next step: the consumers
        poll without waiting, and a queue found empty is asked again only after `busy_poll_ms`
        (a fetch is a Redis script call; asked at every step of a small model, the empty
        fetches took a large share of a busy node's CPU: docs/performance.md). An idle node
        waits up to `poll_ms` in all, split between its queues, so a new request is picked up
        within that."""
        taken = 0
        busy = self.engine.has_unfinished_requests()
        now = time.monotonic()
        for index, consumer in enumerate(self.consumers):
            if busy and now - self._found_empty[index] < self.busy_poll_s:
                continue
            consumer.timeout = 0 if busy else max(1, self.poll_ms // len(self.consumers))
            while self.free_slots() > 0:
                outstanding = sum(1 for f in self.inflight.values() if f.consumer is consumer)
                consumer.prefetch = outstanding + self.free_slots()
                message = next(consumer)
                if message is None:
                    self._found_empty[index] = now
                    break
                self._admit(consumer, message)
                taken += 1
        self.send_starts(force=False)
        return taken

    def _admit(self, consumer: Consumer, message: MessageProxy) -> None:
        body = message.args[0] if message.args else None
        running = self.inflight.get(body.get("request_id")) if isinstance(body, dict) else None
        if running is not None:
            # A copy of a request this node runs: the run under way will record it. A copy
            # under a new key (the sweep dispatched again a job whose messages the broker lost)
            # is acked. The same message again (the broker requeued it, taking this node for
            # dead) is not: that ack would drop the running request's message from the broker,
            # and the sweep would take it for lost; the run's own ack settles both.
            if message_key(message) != message_key(running.message):
                consumer.ack(message)
            return
        try:
            request = GenerationRequest.from_message(body)
            if (
                request.prefill is not None
                and self.remote is not None
                and not self.engine.has_blocks_for(
                    request.prompt_token_ids, request.sampling.max_tokens, request.org
                )
            ):
                # A decode node takes a split request only with the blocks for its prompt and
                # its max_tokens reserve free: back to the broker, for a node that has them.
                consumer.requeue([message])
                self._full_until_step = True
                return
            if request.deadline is not None and request.deadline <= time.time():
                # It waited in the broker past its deadline: report it expired, compute nothing.
                raise RequestExpiredError("the job's deadline passed before it started")
            remote = request.prefill is not None and self.remote is not None
            added, deferred = [], []
            for index in range(request.n):
                # Each choice samples with its own seed, so seeded choices differ but repeat.
                seed = request.sampling.seed
                params = dataclasses.replace(
                    request.sampling, seed=None if seed is None else seed + index
                )
                engine_id = sequence_id(request.request_id, index, request.n)
                if remote and index > 0:  # the same prompt: choice 0 validates it
                    deferred.append((engine_id, params))
                    continue
                added.append(engine_id)
                try:
                    self.engine.add_request(
                        engine_id,
                        request.prompt_token_ids,
                        params,
                        namespace=request.org,
                        deadline=request.deadline,
                        remote_prefill=remote,
                    )
                except InvalidRequestError:
                    for done in added[:-1]:  # reported by the next step, to nobody
                        self.engine.abort(done)
                    raise
            if remote:
                self.remote.expect(added[0], request.prefill["queue"])
        except InvalidRequestError as error:
            self._reject(consumer, message, body, error)
            return
        flight = _InFlight(request, consumer, message, [_Choice() for _ in range(request.n)])
        flight.deferred = deferred
        self.inflight[request.request_id] = flight
        for index, engine_id in enumerate(added + [engine_id for engine_id, _ in deferred]):
            self.sequences[engine_id] = (flight, index)
        if not self.unsent_starts:
            self._starts_since = time.monotonic()
        self.unsent_starts.append(
            {"request_id": request.request_id, "job_id": request.job_id, "attempt": request.attempt}
        )

    def _report_due(self, since: float, pending: int) -> bool:
        """Whether reports held since `since` go now: after `report_ms`, when as many wait as
        the engine runs at once, or when the engine has nothing left to run."""
        return (
            time.monotonic() - since >= self.report_s
            or pending >= self.engine.config.max_num_seqs
            or not self.engine.has_unfinished_requests()
        )

    def send_starts(self, force: bool = True) -> None:
        """The start notices not sent yet, as one message (the worker marks them running in one
        statement); unless `force`, only once they are due (_report_due). Kept for the next call
        while the broker is down. Sent before any of their results."""
        if not self.unsent_starts:
            return
        if force or self._report_due(self._starts_since, len(self.unsent_starts)):
            payload = {"node": self.node_id, "starts": self.unsent_starts}
            self._enqueue(RECORD_STARTED_ACTOR, payload)
            self.unsent_starts = []

    def _reject(self, consumer, message, body, error: InvalidRequestError) -> None:
        """A request the engine can never serve: report it failed, and do not redeliver it."""
        request_id = body.get("request_id") if isinstance(body, dict) else None
        request = GenerationRequest(
            request_id=str(request_id or message.message_id),
            prompt_token_ids=[],
            sampling=SamplingParams(),
            job_id=body.get("job_id") if isinstance(body, dict) else None,
            reply_channel=body.get("reply_channel") if isinstance(body, dict) else None,
        )
        payload = completion_payload(
            request,
            self.node_id,
            "",
            [],
            None,
            0,
            0,
            Timings(),
            error=str(error),
            error_code="expired" if isinstance(error, RequestExpiredError) else None,
        ).as_message()
        with self._log_context(request):
            logger.warning("refused: %s", error)
        self._record(payload, message)
        if request.reply_channel and self.publisher:
            self.publisher.send(
                request.reply_channel,
                {"type": "error", "message": str(error), "param": error.param},
            )
        consumer.ack(message)

    # ---- running ----------------------------------------------------------------------------
    def step(self) -> None:
        self._full_until_step = False
        for output in self.metrics.timed_step(self.engine):
            found = self.sequences.get(output.request_id)
            if found is not None:
                with self._log_context(found[0].request):
                    self._handle(*found, output)
        if self.remote is not None:
            self.remote.send_requests()
        self.record_finished()

    def _start_deferred(self, flight: _InFlight) -> None:
        """The first choice has its prompt's KV: the others start, served from the cache."""
        for engine_id, params in flight.deferred:
            self.engine.add_request(
                engine_id,
                flight.request.prompt_token_ids,
                params,
                namespace=flight.request.org,
                deadline=flight.request.deadline,
            )
        flight.deferred = []

    def _handle(self, flight: _InFlight, index: int, output: RequestOutput) -> None:
        if index == 0 and self.remote is not None and flight.prefill_node is None:
            flight.prefill_node = self.remote.forget(output.request_id)
        if index == 0 and flight.deferred:
            self._start_deferred(flight)
        choice = flight.choices[index]
        text = storable_text(output.text)
        choice.text.append(text)
        choice.token_ids.extend(output.token_ids)
        entries = logprob_entries(self.engine.tokenizer, output.logprobs)
        choice.logprobs.extend(entries)
        if index == 0:
            flight.output = output
        channel = flight.request.reply_channel
        if channel and self.publisher and (text or output.token_ids):
            # Every delta says where it runs and what hit the cache, so a stream's first one can
            # set the response headers.
            self.publisher.send(
                channel,
                {
                    "type": "delta",
                    "index": index,
                    "text": text,
                    "token_ids": output.token_ids,
                    "node": self.node_id,
                    "prefill_node": flight.prefill_node,
                    "cached_tokens": output.cached_tokens,
                    "logprobs": entries or None,
                    "system_fingerprint": self.engine.system_fingerprint,
                },
            )
        if not output.finished:
            return
        choice.finish_reason = output.finish_reason
        del self.sequences[output.request_id]
        if any(c.finish_reason is None for c in flight.choices):
            return
        payload = self._payload(flight)
        self.metrics.finished(flight.output.timings)
        usage = payload["usage"]
        logger.info(
            "finished: %s, %d prompt tokens (%d cached), %d completion tokens",
            payload["finish_reason"],
            usage["prompt_tokens"],
            usage["cached_tokens"],
            usage["completion_tokens"],
        )
        # The waiting client first: the send is scheduled on the publisher's thread, while the
        # record is a broker round trip (the ack, after it, still waits for the record).
        if channel and self.publisher:
            self.publisher.send(channel, {"type": "done", **payload})
        del self.inflight[flight.request.request_id]
        if not self.finished:
            self._finished_since = time.monotonic()
        self.finished.append((payload, flight))

    def record_finished(self, force: bool = False) -> None:
        """Report the finished requests together once they are due (_report_due) or `force`,
        their start notices first, then ack the messages they answer; kept, their messages
        unacked, until the broker is back (send_unrecorded)."""
        if not self.finished or not (
            force or self._report_due(self._finished_since, len(self.finished))
        ):
            return
        self.send_starts()
        finished, self.finished = self.finished, []
        try:
            self._record_all(finished)
        except BROKER_DOWN:
            self.unrecorded.extend(finished)
            return
        ack_all(self.broker, [(flight.consumer, flight.message) for _, flight in finished])

    def _payload(self, flight: _InFlight) -> dict[str, Any]:
        """The `record_completion` of a request whose choices all finished: the first choice's
        text at the top (as with n = 1), every choice under `choices` when n > 1. The prompt
        counts once; completion tokens add up over the choices."""
        first, output = flight.choices[0], flight.output
        wants_logprobs = flight.request.sampling.logprobs
        result = completion_payload(
            flight.request,
            self.node_id,
            "".join(first.text),
            first.token_ids,
            first.finish_reason,
            output.prompt_tokens,
            output.cached_tokens,
            output.timings,
            logprobs=first.logprobs if wants_logprobs else None,
        )
        result.prefill_node = flight.prefill_node
        result.system_fingerprint = self.engine.system_fingerprint
        if flight.request.n > 1:
            result.choices = [
                {
                    "text": "".join(c.text),
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "logprobs": c.logprobs if wants_logprobs else None,
                }
                for c in flight.choices
            ]
            result.usage.completion_tokens = sum(len(c.token_ids) for c in flight.choices)
        return result.as_message()

    def send_unrecorded(self) -> None:
        """Record the results finished while the broker was away, then ack their messages (an
        ack of a message the broker no longer holds is a no-op)."""
        if not self.unrecorded:
            return  # start notices kept while the broker was down go with the next pull
        self.send_starts()
        pending = self.unrecorded
        self._record_all(pending)
        self.unrecorded = []
        self.recorded_late += len(pending)
        ack_all(self.broker, [(flight.consumer, flight.message) for _, flight in pending])

    def _record_all(self, finished: list[tuple[dict[str, Any], _InFlight]]) -> None:
        """One `record_completion` message for these results (protocol.results_of); a single
        one goes as before, under its own key."""
        if len(finished) == 1:
            [(payload, flight)] = finished
            self._record(payload, flight.message)
            return
        answered = [key for _, flight in finished if (key := message_key(flight.message))]
        body = {
            "node": self.node_id,
            "results": [payload for payload, _ in finished],
            "answered": answered,
        }
        enqueue_results(self.broker, self._message(RECORD_COMPLETION_ACTOR, body), answered)

    def _record(self, payload: dict[str, Any], message: MessageProxy) -> None:
        """The result, keyed after the message it answers (keyed_messages), so the sweep can
        tell a result still on its way from a job lost with the broker."""
        key = message_key(message)
        self._enqueue(RECORD_COMPLETION_ACTOR, payload, key and key + RECORD_SUFFIX)

    def _message(self, actor_name: str, payload: dict[str, Any]) -> dramatiq.Message:
        return dramatiq.Message(
            queue_name=CONTROLPLANE_QUEUE,
            actor_name=actor_name,
            args=(payload,),
            kwargs={},
            options={},
        )

    def _enqueue(self, actor_name: str, payload: dict[str, Any], key: str | None = None) -> None:
        message = self._message(actor_name, payload)
        if key:
            enqueue_keyed(self.broker, message, key)
        else:
            self.broker.enqueue(message)

    def read_control(self, interval_s: float = 0.1, wait_ms: int = 0) -> None:
        """Apply the control queue's messages, at most every `interval_s` (every call while
        requests await their KV), waiting up to `wait_ms` for the first. An abort of a request
        this node runs stops it now (its result, with what it generated, is recorded as usual);
        one for a request it does not run is dropped. A `prefill_done` lets a request that
        awaited its KV run on."""
        now = time.monotonic()
        awaiting = self.remote is not None and self.remote.awaiting > 0
        if not awaiting and now - self._last_control < interval_s:
            return
        self._last_control = now
        self.control.timeout = wait_ms
        while (message := next(self.control)) is not None:
            self.control.timeout = 0
            body = message.args[0] if message.args else {}
            if message.actor_name == ABORT_ACTOR and isinstance(body, dict):
                request_id = body.get("request_id")
                if request_id in self.inflight and self._abort(request_id):
                    with self._log_context(self.inflight[request_id].request):
                        logger.info("aborted %s at the control plane's request", request_id)
            elif (
                message.actor_name == PREFILL_DONE_ACTOR
                and isinstance(body, dict)
                and self.remote is not None
            ):
                self.remote.on_done(body)
            self.control.ack(message)
        self.control.timeout = 0

    def _abort(self, request_id: str) -> bool:
        """Stop every choice of a request; True if one was still running. Choices that had
        not started (deferred) finish with reason 'abort', having generated nothing."""
        flight = self.inflight[request_id]
        n = flight.request.n
        for engine_id, _ in flight.deferred:
            _, index = self.sequences.pop(engine_id)
            flight.choices[index].finish_reason = "abort"
        flight.deferred = []
        stopped = [self.engine.abort(sequence_id(request_id, i, n)) for i in range(n)]
        return any(stopped)

    def drain(self) -> None:
        """Stop taking work: `run` finishes and reports the requests the engine holds, then
        returns. Only sets a flag, so a signal handler may call it."""
        self.draining = True

    def _start_draining(self) -> None:
        """Leave the registry, so that no gateway routes here any more, and give back what the
        consumers had fetched."""
        self._drain_started = True
        logger.info("draining: finishing %d running request(s), taking no more", len(self.inflight))
        self.beat(force=True)
        self._give_back_fetched()

    def _give_back_fetched(self) -> None:
        """Hand the broker back what the consumers hold but the engine did not take: the Redis
        consumer fetches several messages at once and puts them back now; RabbitMQ's, which
        the broker pushes messages to, gives them back when its connection closes, at exit.
        Asking them is also what keeps a RabbitMQ consumer's connection alive (heartbeats) and
        sends its acks, so a draining node asks every DRAIN_POLL_S."""
        self._gave_back_at = time.monotonic()
        for consumer in self.consumers:
            consumer.prefetch, consumer.timeout = 0, 0  # hands out what it holds, fetches nothing
            fetched = []
            while (message := next(consumer)) is not None:
                fetched.append(message)
            consumer.requeue(fetched)

    def _drained(self) -> bool:
        """Whether a draining node has reported and acked everything it took."""
        if self.engine.has_unfinished_requests():
            return False
        self.send_starts()
        self.record_finished(force=True)
        return not (self.inflight or self.finished or self.unrecorded)

    def beat(self, force: bool = False) -> None:
        """Publish load and cache state, at most every `heartbeat_interval_s`; while draining,
        only that the node is alive (the sweeper must not take its running requests away)."""
        self.heartbeats.beat(self._state, force)

    def _log_context(self, request: GenerationRequest):
        """The log context of `request`'s handling (inference/protocol/logs.py)."""
        return log_context(request_id=request.request_id, job_id=request.job_id, org=request.org)

    def _state(self) -> dict[str, Any] | None:
        self.metrics.engine_stats(self.engine.stats())  # the heartbeat's figures, for /metrics
        if self.draining:
            return None
        return engine_state(
            self.node_id,
            self.model,
            self.role,
            self.engine,
            self.free_slots(),
            kv_layout=self.kv_layout,
            disagg=self.remote.stats() if self.remote is not None else disagg_counters(),
        )

    def run(self, stop: threading.Event) -> None:
        """Serve until `stop` is set, or after `drain()` until every request taken is reported
        and acked. At `stop`, unfinished requests are aborted and left unacked, so the broker
        redelivers them to another node. Either way the node leaves the registry."""
        bind_log_context(node=self.node_id)  # every line of this thread names the node
        self.beat(force=True)
        broker_down = False
        while not stop.is_set():
            try:
                self.send_unrecorded()
                if not self.draining:
                    self.pull()
                elif not self._drain_started:
                    self._start_draining()
                elif self._drained():
                    logger.info("drained")
                    break
                elif time.monotonic() - self._gave_back_at >= DRAIN_POLL_S:
                    self._give_back_fetched()
                self.read_control()
                if self.engine.has_unfinished_requests():
                    self.step()
                    if not self.engine.has_runnable_requests():
                        # Only KV to wait for: wait on the control queue, not in a busy loop.
                        self.read_control(wait_ms=self.poll_ms)
                self.engine.release_holds()
                self.beat()
                if broker_down:
                    logger.warning("broker back; %d result(s) recorded late", self.recorded_late)
                    broker_down = False
            except BROKER_DOWN as error:
                # The engine keeps its requests; pulling and reporting resume when it is back.
                if not broker_down:
                    logger.warning("broker unavailable (%s); retrying", error)
                    broker_down, self.recorded_late = True, 0
                if self.engine.has_unfinished_requests():
                    self.step()
                else:
                    stop.wait(BROKER_RETRY_S)
        with contextlib.suppress(*BROKER_DOWN):  # unacked, they are run again elsewhere
            self.record_finished(force=True)
        for request_id in list(self.inflight):
            self._abort(request_id)
        for consumer in [*self.consumers, self.control]:
            consumer.close()
        with contextlib.suppress(*BROKER_DOWN):  # else its state expires with its TTL
            self.heartbeats.leave()

"""Broker messages stored under a key of our choosing, so the control plane can ask later whether
a message is still held by the broker.

Dramatiq's Redis broker keeps every message in the hash `<namespace>:<queue>.msgs` from enqueue
until its ack, under a fresh uuid. Hearth enqueues a job's generation message under
`<request_id>.<dispatch>` instead, and the node its result under `<that key>.record`; at every
moment between admission and settlement one of the two is in the broker. When neither is (Redis
restarted without persistence, or failed over to a replica that lacked them), the job was lost
with the broker and the sweep dispatches it again (controlplane/dispatch/redelivery.py).

A key must survive everything Dramatiq does to a message. Its Redis broker gives each enqueue a
fresh uuid, and a retry (the Retries middleware, after an actor raised) or a delayed message's move
from `<queue>.DQ` back to `<queue>` is an enqueue: a result whose `record_completion` failed once
would come back under a uuid, and the sweep, finding neither key, would run its job again. So
Hearth runs `KeyedRedisBroker`, which enqueues a message that carries its key (the `hearth_key`
option) under that key every time, and `held_keys` looks in the delay queue too.

The results a node finished within its report window (`report_ms`) travel as one message (a
settling transaction for all of them), stored under a key of its own, `results.<node>.<uuid>`.
Before enqueuing it, the node writes an index, the hash `<namespace>:results-of`, from each
answered message's key to that key; `held_keys` follows it, so a job whose result waits in such
a message counts as held. The worker deletes its entries once it has settled them
(`forget_results`); an entry left behind (a worker killed in between) points at a message no
longer held, which the sweep reads as not held, as it should.

Other brokers get a plain enqueue and cannot be asked: the in-process StubBroker loses nothing
while its process lives, and RabbitMQ keeps durable queues on disk.
"""

from __future__ import annotations

import uuid

from dramatiq import Message
from dramatiq.broker import Consumer
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import current_millis, dq_name

RECORD_SUFFIX = ".record"
KEY_OPTION = "hearth_key"
RESULTS_INDEX = "results-of"  # answered message key → the key of the message with its result


class KeyedRedisBroker(RedisBroker):
    """Dramatiq's Redis broker, except that a message carrying a key (KEY_OPTION) is stored under
    it on every enqueue: the first, a retry's (into the delay queue) and the delay queue's
    hand-back."""

    def enqueue(self, message: Message, *, delay: int | None = None) -> Message:
        key = message.options.get(KEY_OPTION)
        if key is None:
            return super().enqueue(message, delay=delay)
        options: dict = {"redis_message_id": key}
        queue_name = message.queue_name
        if delay is not None:
            queue_name = dq_name(queue_name)
            options["eta"] = current_millis() + delay
        message = message.copy(queue_name=queue_name, options=options)
        self.emit_before("enqueue", message, delay)
        self.do_enqueue(queue_name, key, message.encode())
        self.emit_after("enqueue", message, delay)
        return message

    def ack_all(self, acks: list[tuple[Consumer, Message]]) -> None:
        """Ack fetched messages, each on the queue its consumer reads, in one round trip: the
        same script call as each consumer's `ack`, pipelined (a node acks together the messages
        it answered within one report window)."""
        dispatch = self.scripts["dispatch"]
        pipeline = self.client.pipeline(transaction=False)
        for consumer, message in acks:
            # The arguments RedisBroker._dispatch passes the script before the command's own.
            args = [
                "ack",
                current_millis(),
                consumer.queue_name,
                self.broker_id,
                self.heartbeat_timeout,
                self.dead_message_ttl,
                0,  # no maintenance on an ack (Dramatiq's own acks never do it either)
                self._max_unpack_size(),
                message.options["redis_message_id"],
            ]
            dispatch(keys=[self.namespace], args=args, client=pipeline)
        try:
            pipeline.execute()
        finally:
            for consumer, message in acks:
                consumer.queued_message_ids.discard(message.message_id)


def keeps_keys(broker) -> bool:
    """Whether `broker` stores messages under keys we choose and can be asked for them."""
    return isinstance(broker, KeyedRedisBroker)


def enqueue_keyed(broker, message: Message, key: str) -> None:
    """Enqueue `message` under `key` (Redis; kept through retries), or plainly (other brokers)."""
    if keeps_keys(broker):
        message = message.copy(options={KEY_OPTION: key})
    broker.enqueue(message)


def ack_all(broker, acks: list[tuple[Consumer, Message]]) -> None:
    """Ack each `(consumer, message)`: in one round trip on Redis, one by one elsewhere."""
    if keeps_keys(broker):
        broker.ack_all(acks)
        return
    for consumer, message in acks:
        consumer.ack(message)


def enqueue_results(broker, message: Message, answered: list[str]) -> None:
    """Enqueue `message`, the results of the messages stored under the keys `answered`, under a
    key of its own, after indexing it under each of them (module docstring); plainly on other
    brokers."""
    if not keeps_keys(broker):
        broker.enqueue(message)
        return
    key = f"results.{uuid.uuid4().hex}"
    broker.client.hset(f"{broker.namespace}:{RESULTS_INDEX}", mapping=dict.fromkeys(answered, key))
    enqueue_keyed(broker, message, key)


def forget_results(broker, answered: list[str]) -> None:
    """Drop the index entries of results that are settled (the worker, after its commit)."""
    if keeps_keys(broker) and answered:
        broker.client.hdel(f"{broker.namespace}:{RESULTS_INDEX}", *answered)


def message_key(message) -> str | None:
    """The key a message fetched from the broker is stored under (None off Redis)."""
    return message.options.get("redis_message_id")


def held_keys(broker, wanted: list[tuple[str, str]]) -> list[bool] | None:
    """For each `(queue, key)`, whether the broker still holds that message, in the queue or
    waiting in its delay queue for a retry; None when the broker cannot be asked (not Redis). A
    result's key (`<key>.record`) also counts as held when the result travels in a message of
    several results that the broker holds (module docstring). One or two pipelined round trips."""
    if not keeps_keys(broker):
        return None
    index = f"{broker.namespace}:{RESULTS_INDEX}"
    pipeline = broker.client.pipeline(transaction=False)
    for queue, key in wanted:
        pipeline.hexists(f"{broker.namespace}:{queue}.msgs", key)
        pipeline.hexists(f"{broker.namespace}:{dq_name(queue)}.msgs", key)
        pipeline.hget(index, key.removesuffix(RECORD_SUFFIX))
    found = pipeline.execute()
    held = [bool(found[3 * i] or found[3 * i + 1]) for i in range(len(wanted))]
    carried = [
        (i, queue, found[3 * i + 2].decode())
        for i, (queue, key) in enumerate(wanted)
        if not held[i] and key.endswith(RECORD_SUFFIX) and found[3 * i + 2] is not None
    ]
    if carried:
        pipeline = broker.client.pipeline(transaction=False)
        for _, queue, key in carried:
            pipeline.hexists(f"{broker.namespace}:{queue}.msgs", key)
            pipeline.hexists(f"{broker.namespace}:{dq_name(queue)}.msgs", key)
        found = pipeline.execute()
        for n, (i, _, _) in enumerate(carried):
            held[i] = bool(found[2 * n] or found[2 * n + 1])
    return held

"""Broker messages stored under a key of our choosing, so the control plane can ask later whether
a message is still held by the broker.

Dramatiq's Redis broker keeps every message in the hash `<namespace>:<queue>.msgs` from enqueue
until its ack, under a fresh uuid. Hearth enqueues a job's generation message under
`<request_id>.<dispatch>` instead, and the node its result under `<that key>.record`; at every
moment between admission and settlement one of the two is in the broker. When neither is (Redis
restarted without persistence, or failed over to a replica that lacked them), the job was lost
with the broker and the sweep dispatches it again (controlplane/jobs/redelivery.py).

A key must survive everything Dramatiq does to a message. Its Redis broker gives each enqueue a
fresh uuid, and a retry (the Retries middleware, after an actor raised) or a delayed message's move
from `<queue>.DQ` back to `<queue>` is an enqueue: a result whose `record_completion` failed once
would come back under a uuid, and the sweep, finding neither key, would run its job again. So
Hearth runs `KeyedRedisBroker`, which enqueues a message that carries its key (the `hearth_key`
option) under that key every time, and `held_keys` looks in the delay queue too.

Other brokers get a plain enqueue and cannot be asked: the in-process StubBroker loses nothing
while its process lives, and RabbitMQ keeps durable queues on disk.
"""

from __future__ import annotations

from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import current_millis, dq_name

RECORD_SUFFIX = ".record"
KEY_OPTION = "hearth_key"


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


def keeps_keys(broker) -> bool:
    """Whether `broker` stores messages under keys we choose and can be asked for them."""
    return isinstance(broker, KeyedRedisBroker)


def enqueue_keyed(broker, message: Message, key: str) -> None:
    """Enqueue `message` under `key` (Redis; kept through retries), or plainly (other brokers)."""
    if keeps_keys(broker):
        message = message.copy(options={KEY_OPTION: key})
    broker.enqueue(message)


def message_key(message) -> str | None:
    """The key a message fetched from the broker is stored under (None off Redis)."""
    return message.options.get("redis_message_id")


def held_keys(broker, wanted: list[tuple[str, str]]) -> list[bool] | None:
    """For each `(queue, key)`, whether the broker still holds that message, in the queue or
    waiting in its delay queue for a retry; None when the broker cannot be asked (not Redis).
    One pipelined round trip."""
    if not keeps_keys(broker):
        return None
    pipeline = broker.client.pipeline(transaction=False)
    for queue, key in wanted:
        pipeline.hexists(f"{broker.namespace}:{queue}.msgs", key)
        pipeline.hexists(f"{broker.namespace}:{dq_name(queue)}.msgs", key)
    found = pipeline.execute()
    return [bool(found[2 * i] or found[2 * i + 1]) for i in range(len(wanted))]

"""Broker messages stored under a key of our choosing, so the control plane can ask later whether
a message is still held by the broker.

Dramatiq's Redis broker keeps every message in the hash `<namespace>:<queue>.msgs` from enqueue
until its ack, under a fresh uuid. Hearth enqueues a job's generation message under
`<request_id>.<dispatch>` instead, and the node its result under `<that key>.record`; at every
moment between admission and settlement one of the two is in the broker. When neither is (Redis
restarted without persistence, or failed over to a replica that lacked them), the job was lost
with the broker and the sweep dispatches it again (controlplane/jobs/redelivery.py).

Other brokers get a plain enqueue and cannot be asked: the in-process StubBroker loses nothing
while its process lives, and RabbitMQ keeps durable queues on disk.
"""

from __future__ import annotations

from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker

RECORD_SUFFIX = ".record"


def keeps_keys(broker) -> bool:
    """Whether `broker` stores messages under keys we choose and can be asked for them."""
    return isinstance(broker, RedisBroker)


def enqueue_keyed(broker, message: Message, key: str) -> None:
    """Enqueue `message` under `key` (Redis), or plainly (any other broker)."""
    if not keeps_keys(broker):
        broker.enqueue(message)
        return
    message = message.copy(options={"redis_message_id": key})
    broker.emit_before("enqueue", message, None)
    broker.do_enqueue(message.queue_name, key, message.encode())
    broker.emit_after("enqueue", message, None)


def message_key(message) -> str | None:
    """The key a message fetched from the broker is stored under (None off Redis)."""
    return message.options.get("redis_message_id")


def held_keys(broker, wanted: list[tuple[str, str]]) -> list[bool] | None:
    """For each `(queue, key)`, whether the broker still holds that message; None when the
    broker cannot be asked (not Redis). One pipelined round trip."""
    if not keeps_keys(broker):
        return None
    pipeline = broker.client.pipeline(transaction=False)
    for queue, key in wanted:
        pipeline.hexists(f"{broker.namespace}:{queue}.msgs", key)
    return [bool(found) for found in pipeline.execute()]

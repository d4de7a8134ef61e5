"""Sending a message to a Dramatiq actor, by the actor's name, through this process's broker.

The control plane's one way to enqueue: a job's generation message (dispatch/enqueue.py), an
abort for a node (Job.abort_on), an event's fan-out to the worker (events/models.py). By name,
so a sender needs neither the actor nor the module that defines it.
"""

from __future__ import annotations

from typing import Any

import dramatiq

from inference.protocol.keyed_messages import enqueue_keyed


def send(queue: str, actor_name: str, payload: Any, key: str | None = None) -> None:
    """Enqueue `payload`, the one argument of `actor_name`, on `queue`; under `key` when given,
    so the broker holds it until it is answered (inference.protocol.keyed_messages)."""
    broker = dramatiq.get_broker()
    # Embedded mode's StubBroker enqueues only to queues declared to it; a node's queue has no
    # actor in this process to declare it.
    broker.declare_queue(queue)
    message = dramatiq.Message(
        queue_name=queue, actor_name=actor_name, args=(payload,), kwargs={}, options={}
    )
    if key is None:
        broker.enqueue(message)
    else:
        enqueue_keyed(broker, message, key)

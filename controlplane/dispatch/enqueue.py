"""The enqueue: a job's generation message into the broker, under the job's message key
(inference.protocol.keyed_messages), on the queue its route chose, naming the prefill queue when
the route split it (disaggregation.py)."""

from __future__ import annotations

import logging

from controlplane.api.errors import ApiError
from controlplane.broker import send
from controlplane.dispatch.routing import Route
from controlplane.jobs.models import Job
from inference.protocol.messages import GENERATE_ACTOR

logger = logging.getLogger(__name__)


def dispatch(job: Job, queue: str, reply_channel: str | None, deadline: float) -> None:
    """Send the job's generation message to `queue`, under the job's message key."""
    send(queue, GENERATE_ACTOR, job.generation_message(reply_channel, deadline), job.message_key())


def enqueue_job(job: Job, route: Route, reply_channel: str | None, deadline: float) -> None:
    """Send the job's generation message to its route; a broker that refuses it fails the job
    and answers 503."""
    prefill_queue = route.prefill_queue or ""
    # A batch's jobs are written before their routes are chosen.
    if (job.queue, job.prefill_queue) != (route.queue, prefill_queue):
        job.queue, job.prefill_queue = route.queue, prefill_queue
        Job.objects.filter(pk=job.pk).update(queue=route.queue, prefill_queue=prefill_queue)
    try:
        dispatch(job, route.queue, reply_channel, deadline)
    except Exception as error:
        logger.exception("enqueue of %s failed", job.id)
        job.fail(f"the broker refused the request: {error}")
        raise ApiError(
            503, "The request could not be queued; try again.", code="broker_unavailable"
        ) from error

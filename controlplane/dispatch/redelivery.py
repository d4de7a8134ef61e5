"""Jobs lost with the broker, dispatched again from the database.

The database is the record of work; the broker only carries it. Between admission and
settlement, the broker always holds a job's generation message (until the node that answers it
acks) or its result (until the worker records it): the node enqueues the result before it acks.
A Redis that restarts without persistence, or fails over to a replica that lacked the latest
writes, drops both. `redeliver_lost` finds every open job that has been in the broker longer
than a grace period and of which the broker holds neither message (keys in
inference/protocol/keyed_messages.py), and dispatches it again under a new key, to the route a new
request would take now (its old node may be gone). Whether a prefill node computes its prompt is
decided again too (disaggregation.py), as for a new request: the prefill node it was sent to may
be the one that died, and its decode node may now hold the prompt.

A job whose messages were lost while a node still runs it gets a second run; the node that
already runs it drops the copy (Node._admit), another node runs it again, and the control plane
records whichever result comes first, once (`record_completion` is idempotent). A sync request
whose message was lost gets its answer from the job's row (completions._receive polls it when the
reply channel stays quiet).

A node that dies strands the messages in its own queue (`infer.<model>.<node>`: affinity and
prefix-aware routing send work there), and the broker puts back the ones it had taken in that
same queue, which nobody else reads. `reroute_from_dead_nodes` dispatches again every open job
queued for, or running on, a node silent for NODE_DEAD_AFTER_S, to the route a new request would
take (the model's shared queue: any node with room). If the node comes back, it may run its old
copy too; whichever result comes first is recorded, once.

Run by `manage.py sweepjobs`, beside the worker. In embedded mode the in-process broker loses
everything with its process, so `redispatch_open` sends every open job again at start-up.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import dramatiq
from django.conf import settings
from django.db.models import F
from django.utils import timezone

from controlplane.catalog.registry import live_nodes, seen_within
from controlplane.dispatch.disaggregation import split
from controlplane.dispatch.enqueue import dispatch
from controlplane.dispatch.routing import choose_route
from controlplane.jobs.models import Job
from inference.protocol.keyed_messages import RECORD_SUFFIX, held_keys, keeps_keys
from inference.protocol.messages import CONTROLPLANE_QUEUE, queue_node

logger = logging.getLogger(__name__)
BATCH = 500


def redeliver_lost(grace_s: float) -> int | None:
    """Dispatch again every open job the broker lost; how many (None: this broker cannot tell)."""
    broker = dramatiq.get_broker()
    if not keeps_keys(broker):
        return None
    cutoff = timezone.now() - timedelta(seconds=grace_s)
    open_jobs = (
        Job.objects.filter(status__in=[Job.QUEUED, Job.RUNNING], dispatched_at__lt=cutoff)
        .select_related("org")
        .order_by("pk")
    )
    redelivered, last = 0, ""
    while True:
        jobs = list(open_jobs.filter(pk__gt=last)[:BATCH])
        if not jobs:
            return redelivered
        last = jobs[-1].pk
        wanted = []
        for job in jobs:
            key = job.message_key()
            wanted += [(job.queue, key), (CONTROLPLANE_QUEUE, key + RECORD_SUFFIX)]
        held = held_keys(broker, wanted)
        for index, job in enumerate(jobs):
            if not (held[2 * index] or held[2 * index + 1]):
                redelivered += _dispatch_again(job)


def reroute_from_dead_nodes(grace_s: float) -> int:
    """Dispatch again every open job, dispatched over `grace_s` ago, that waits in the queue of
    a dead node or runs on one: a node that has not beaten for NODE_DEAD_AFTER_S (a node in a
    long step misses its heartbeat's TTL, and must not have its work run twice). How many."""
    cutoff = timezone.now() - timedelta(seconds=grace_s)
    open_jobs = Job.objects.filter(
        status__in=[Job.QUEUED, Job.RUNNING], dispatched_at__lt=cutoff
    ).select_related("org")
    jobs = [
        (job, job.node if job.status == Job.RUNNING else queue_node(job.model, job.queue))
        for job in open_jobs.order_by("pk").iterator(chunk_size=BATCH)
    ]
    named = sorted({node for _, node in jobs if node})
    alive = seen_within(named, settings.NODE_DEAD_AFTER_S)
    rerouted = 0
    for job, node in jobs:
        if not node or node in alive or not _dispatch_again(job):
            continue
        rerouted += 1
        if job.status == Job.RUNNING:
            # It runs nowhere now; the node that takes the new message records itself.
            Job.objects.filter(pk=job.pk, status=Job.RUNNING, node=node).update(node="")
    return rerouted


def redispatch_open() -> int:
    """Dispatch again every open job: for a broker that kept nothing (embedded start-up)."""
    jobs = Job.objects.filter(status__in=[Job.QUEUED, Job.RUNNING]).select_related("org")
    return sum(_dispatch_again(job) for job in jobs.order_by("created"))


def _dispatch_again(job: Job) -> int:
    """One more dispatch of `job` under a new key; 0 when it settled or another sweep took it."""
    nodes = live_nodes(job.model)
    route = choose_route(job.model, nodes, job.session_affinity or None)
    route = split(job.model, nodes, route, job.prompt_token_ids, job.org.slug)
    prefill_queue = route.prefill_queue or ""
    now = timezone.now()
    claimed = Job.objects.filter(
        pk=job.pk, status__in=[Job.QUEUED, Job.RUNNING], dispatches=job.dispatches
    ).update(
        dispatches=F("dispatches") + 1,
        dispatched_at=now,
        queue=route.queue,
        prefill_queue=prefill_queue,
    )
    if not claimed:
        return 0
    job.dispatches, job.dispatched_at = job.dispatches + 1, now
    job.queue, job.prefill_queue = route.queue, prefill_queue
    deadline = job.deadline_at.timestamp() if job.deadline_at else None
    dispatch(job, route.queue, None, deadline)
    logger.warning("job %s dispatched again, to %s", job.id, route.queue)
    return 1

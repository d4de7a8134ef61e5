"""The control plane's Dramatiq actors (django-dramatiq discovers `tasks` modules)."""

from __future__ import annotations

import dramatiq

from controlplane.jobs.models import Job
from inference.node.keyed_messages import forget_results
from inference.node.protocol import (
    CONTROLPLANE_QUEUE,
    RECORD_COMPLETION_ACTOR,
    RECORD_STARTED_ACTOR,
    results_of,
)


@dramatiq.actor(actor_name=RECORD_COMPLETION_ACTOR, queue_name=CONTROLPLANE_QUEUE)
def record_completion(payload: dict) -> None:
    """A node's results (the ones an engine step finished, or one): settle each job and bill
    it, exactly once however often they arrive; then drop their entries from the broker's index
    of results (inference/node/keyed_messages.py)."""
    Job.objects.record_completions(results_of(payload))
    forget_results(dramatiq.get_broker(), payload.get("answered") or [])


@dramatiq.actor(actor_name=RECORD_STARTED_ACTOR, queue_name=CONTROLPLANE_QUEUE)
def record_started(payload: dict) -> None:
    """A node took jobs' requests: mark them running (once; a late notice is a no-op). The
    payload lists the starts of one pull (`starts`), or is a single start (an older node's)."""
    Job.objects.record_starts(payload.get("node") or "", payload.get("starts") or [payload])

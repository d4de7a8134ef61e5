"""The control plane's Dramatiq actors (django-dramatiq discovers `tasks` modules)."""

from __future__ import annotations

import dramatiq

from controlplane.jobs.models import Job
from inference.node.protocol import (
    CONTROLPLANE_QUEUE,
    RECORD_COMPLETION_ACTOR,
    RECORD_STARTED_ACTOR,
)


@dramatiq.actor(actor_name=RECORD_COMPLETION_ACTOR, queue_name=CONTROLPLANE_QUEUE)
def record_completion(payload: dict) -> None:
    """A node's result: settle the job and bill it, exactly once however often it arrives."""
    Job.objects.record_completion(payload)


@dramatiq.actor(actor_name=RECORD_STARTED_ACTOR, queue_name=CONTROLPLANE_QUEUE)
def record_started(payload: dict) -> None:
    """A node took jobs' requests: mark them running (once; a late notice is a no-op). The
    payload lists the starts of one pull (`starts`), or is a single start (an older node's)."""
    Job.objects.record_starts(payload.get("node") or "", payload.get("starts") or [payload])

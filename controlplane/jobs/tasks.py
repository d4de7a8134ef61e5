"""The control plane's Dramatiq actors (django-dramatiq discovers `tasks` modules)."""

from __future__ import annotations

import dramatiq

from controlplane.jobs.models import Job
from inference.node.protocol import CONTROLPLANE_QUEUE, RECORD_COMPLETION_ACTOR


@dramatiq.actor(actor_name=RECORD_COMPLETION_ACTOR, queue_name=CONTROLPLANE_QUEUE)
def record_completion(payload: dict) -> None:
    """A node's result: settle the job and bill it, exactly once however often it arrives."""
    Job.objects.record_completion(payload)

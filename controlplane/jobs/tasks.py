"""The control plane's Dramatiq actors (django-dramatiq discovers `tasks` modules)."""

from __future__ import annotations

import dramatiq

from controlplane.jobs.job_metrics import WorkerMetricsServer
from controlplane.jobs.models import Job
from controlplane.jobs.settlement import record_completions
from inference.protocol.keyed_messages import forget_results
from inference.protocol.messages import (
    CONTROLPLANE_QUEUE,
    RECORD_COMPLETION_ACTOR,
    RECORD_STARTED_ACTOR,
    results_of,
)

# The worker's own /metrics (HEARTH_WORKER_METRICS_PORT), served once a worker process boots.
dramatiq.get_broker().add_middleware(WorkerMetricsServer())


@dramatiq.actor(actor_name=RECORD_COMPLETION_ACTOR, queue_name=CONTROLPLANE_QUEUE)
def record_completion(payload: dict) -> None:
    """A node's results (those it finished within its report window, or one): settle each job
    and bill it, exactly once however often they arrive; then drop their entries from the
    broker's index of results (inference/protocol/keyed_messages.py)."""
    record_completions(results_of(payload))
    forget_results(dramatiq.get_broker(), payload.get("answered") or [])


@dramatiq.actor(actor_name=RECORD_STARTED_ACTOR, queue_name=CONTROLPLANE_QUEUE)
def record_started(payload: dict) -> None:
    """A node took jobs' requests: mark them running (once; a late notice is a no-op). The
    payload lists the starts of one report window (`starts`) of one node (`node`)."""
    Job.objects.record_starts(payload["node"], payload["starts"])

"""What settling a job tells Prometheus and the log, and the worker's own `/metrics`.

Counted once per settled job, after the commit that settled it (a redelivered result settles
nothing and counts nothing), into shared families (controlplane/metrics.py: every worker process
adds to the same Redis hashes, so any of them answers for all), labelled by model and mode
(`sync`, `async`, `batch`):

- `hearth_job_ttft_seconds`, `hearth_job_tpot_seconds`, `hearth_job_e2e_seconds`: the node's
  timings of each completed job (Job.ttft_s, tpot_s, e2e_s; a job that generated one token has
  no TPOT), and `hearth_job_queue_wait_seconds`, from admission to its start (Job.queue_wait_s);
- `hearth_job_prompt_tokens_total`, `hearth_job_cached_tokens_total`,
  `hearth_job_completion_tokens_total`: the usage of every billed job (completed, and cancelled
  or expired with what it generated): the usage ledger's sums;
- `hearth_jobs_settled_total{model, mode, status}`: every job a node's result settled, by its
  final status (a job cancelled or expired before it started settles without one: not counted).

At scrape time, `hearth_broker_queue_depth{queue}`: the messages waiting in each broker queue
that a consumer has not taken yet (the control plane's results queue, every enabled model's shared
queues, every live node's own), read from Redis (LLEN), or the in-process broker in embedded mode.
RabbitMQ's own Prometheus plugin exports its queues' depths; none are read here.

Each settled job also writes one log line, in its request's log context (inference/protocol/
logs.py), so the request id a gateway logged is found again at its settlement.

The worker serves these at `/metrics` on HEARTH_WORKER_METRICS_PORT (`WorkerMetricsServer`, a
Dramatiq middleware: the first worker process of the host to boot binds the port). Embedded mode
registers the same collectors in the gateway's registry (controlplane/embedded.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import dramatiq
from django.conf import settings
from django.db import close_old_connections, transaction
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker
from prometheus_client import start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from controlplane.catalog.models import ServedModel
from controlplane.catalog.registry import every_live_node, node_role, redis_client
from controlplane.metrics import SharedCollector, SharedFamily, count_route_tokens, flush_shared
from inference.protocol import buckets
from inference.protocol.logs import log_context
from inference.protocol.messages import (
    CONTROLPLANE_QUEUE,
    model_queue,
    node_queue,
    prefill_node_queue,
    prefill_queue,
)

if TYPE_CHECKING:
    from controlplane.jobs.settlement import Settlement

logger = logging.getLogger(__name__)

LABELS = ("model", "mode")
TIMINGS = {
    "ttft_s": SharedFamily(
        "hearth_job_ttft_seconds",
        "Completed jobs' time to first token, as their node measured it.",
        LABELS,
        buckets.TTFT_SECONDS,
    ),
    "tpot_s": SharedFamily(
        "hearth_job_tpot_seconds",
        "Completed jobs' time per output token after the first, as their node measured it.",
        LABELS,
        buckets.TPOT_SECONDS,
    ),
    "e2e_s": SharedFamily(
        "hearth_job_e2e_seconds",
        "Completed jobs' time from their arrival at the node to their end, on the node.",
        LABELS,
        buckets.REQUEST_SECONDS,
    ),
    "queue_wait_s": SharedFamily(
        "hearth_job_queue_wait_seconds",
        "Completed jobs' time from admission to their start on a node.",
        LABELS,
        buckets.REQUEST_SECONDS,
    ),
}
TOKENS = {
    field: SharedFamily(
        f"hearth_job_{field}_total", f"{what} of billed jobs (the usage ledger's).", LABELS
    )
    for field, what in (
        ("prompt_tokens", "Prompt tokens"),
        ("cached_tokens", "Prompt tokens served from a node's prefix cache"),
        ("completion_tokens", "Completion tokens"),
    )
}
SETTLED = SharedFamily(
    "hearth_jobs_settled_total",
    "Jobs settled by their node's result, by final status.",
    (*LABELS, "status"),
)
FAMILIES = [*TIMINGS.values(), *TOKENS.values(), SETTLED]


@dataclass(frozen=True)
class _Settled:
    """What counting and logging one settled job needs, read before the commit."""

    request_id: str
    job_id: str
    org: str
    node: str
    model: str
    mode: str
    status: str
    error_code: str
    timings: dict[str, float | None]
    usage: dict[str, int] | None  # None: nothing billed
    route: str
    disaggregated: bool


def count_on_commit(settlements: list[Settlement]) -> None:
    """Count `settlements` (and their route counters, controlplane/metrics.py) and log them once
    the transaction that writes them commits; nothing if it rolls back."""
    if not settlements:
        return
    settled = [
        _Settled(
            request_id=s.job.request_id,
            job_id=s.job.id,
            org=s.job.org.slug,
            node=s.job.node,
            model=s.job.model,
            mode=s.job.mode,
            status=s.job.status,
            error_code=s.job.error_code,
            timings={name: getattr(s.job, name) for name in TIMINGS},
            usage=s.job.result["usage"] if s.record is not None else None,
            route=s.job.route,
            disaggregated=bool(s.job.prefill_node),
        )
        for s in settlements
    ]
    transaction.on_commit(partial(_count, settled), robust=True)


def _count(settled: list[_Settled]) -> None:
    routed = []
    for job in settled:
        labels = (job.model, job.mode)
        SETTLED.inc((*labels, job.status))
        if job.status == "completed":
            for name, family in TIMINGS.items():
                if job.timings[name] is not None:
                    family.observe(labels, job.timings[name])
        if job.usage is not None:
            for name, family in TOKENS.items():
                family.inc(labels, int(job.usage.get(name) or 0))
            if job.route:
                routed.append((job.model, job.route, job.usage, job.disaggregated))
    if settings.REDIS_URL:  # every counter of these jobs in one round trip
        pipe = redis_client().pipeline(transaction=False)
        count_route_tokens(routed, pipe)
        flush_shared(pipe)
        pipe.execute()
    else:
        count_route_tokens(routed)
    for job in settled:
        _log(job)


def _log(job: _Settled) -> None:
    with log_context(request_id=job.request_id, job_id=job.job_id, org=job.org, node=job.node):
        if job.usage is None:
            logger.info("settled: %s (%s)", job.status, job.error_code)
            return
        logger.info(
            "settled: %s, %d prompt tokens (%d cached), %d completion tokens",
            job.status,
            job.usage.get("prompt_tokens") or 0,
            job.usage.get("cached_tokens") or 0,
            job.usage.get("completion_tokens") or 0,
        )


def watched_queues() -> list[str]:
    """The broker queues whose depth is reported: the results queue, every enabled model's
    shared queue and prefill queue, and the own queue of every live node."""
    try:
        models = list(ServedModel.objects.filter(enabled=True).values_list("id", flat=True))
    finally:
        close_old_connections()  # a scrape's thread, not a request's
    queues = [CONTROLPLANE_QUEUE]
    for model in sorted(models):
        queues += [model_queue(model), prefill_queue(model)]
    for node in sorted(every_live_node(), key=lambda n: n["id"]):
        own = prefill_node_queue if node_role(node) == "prefill" else node_queue
        queues.append(own(node.get("model", ""), node["id"]))
    return queues


def queue_depths(broker: Any, queues: list[str]) -> dict[str, int] | None:
    """{queue: messages waiting, not yet taken by a consumer}; None for a broker that is not
    read (RabbitMQ)."""
    if isinstance(broker, RedisBroker):
        pipe = broker.client.pipeline(transaction=False)
        for queue in queues:
            pipe.llen(f"{broker.namespace}:{queue}")
        return dict(zip(queues, pipe.execute(), strict=True))
    if isinstance(broker, StubBroker):
        held = broker.queues
        return {queue: held[queue].qsize() if queue in held else 0 for queue in queues}
    return None


class QueueDepthCollector(Collector):
    """`hearth_broker_queue_depth{queue}`, read from the broker at each scrape."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "hearth_broker_queue_depth",
            "Messages waiting in a broker queue, not yet taken by a consumer.",
            labels=["queue"],
        )
        depths = queue_depths(dramatiq.get_broker(), watched_queues())
        for queue, depth in (depths or {}).items():
            family.add_metric([queue], depth)
        yield family


COLLECTORS = [SharedCollector(FAMILIES), QueueDepthCollector()]
WORKER_REGISTRY = CollectorRegistry()
for _collector in COLLECTORS:
    WORKER_REGISTRY.register(_collector)


class WorkerMetricsServer(dramatiq.Middleware):
    """Serves WORKER_REGISTRY at `/metrics` on HEARTH_WORKER_METRICS_PORT (unset or 0: nowhere)
    when a worker process has booted. The worker runs several processes on a host: the first to
    boot binds the port, and the others find it taken, which is as it should be (the series are
    shared, so one process answers for all). Not in embedded mode, whose gateway serves them."""

    def after_worker_boot(self, broker, worker) -> None:
        # Read here, not in the settings: only the worker serves it, and it may be off.
        port = int(os.environ.get("HEARTH_WORKER_METRICS_PORT") or 0)
        if not port or settings.EMBEDDED:
            return
        try:
            start_http_server(port, registry=WORKER_REGISTRY)
        except OSError as error:
            logger.info("worker /metrics not served here: port %d: %s", port, error)
            return
        logger.info("serving the worker's /metrics on port %d", port)
